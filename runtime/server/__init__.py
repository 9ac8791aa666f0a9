"""`sidindex serve`: the HTTP front (http), its engine and the engine as the front sees it (engine,
engine_api), fair batches (batcher), front-end processes over one engine (frontend, link), the
Arrow Flight endpoint (flight), and the counters (metrics)."""
