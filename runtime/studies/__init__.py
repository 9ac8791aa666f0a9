"""Studies beside serving: pass rates and recall per mode (simulate), and a reference transformer
decoder with a KV cache, the worked example of a user's model (decoder)."""
