"""Moving one request's cache (KV blocks and KDA state) from a prefill instance to a decode instance: byte
transports behind one protocol (no torch; the worker packs and unpacks the tensors)."""
