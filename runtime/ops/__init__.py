"""Device kernels of the runtime, each with a plain torch reference beside it."""
