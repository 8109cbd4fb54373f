"""The prefill/decode disaggregation router (`deltaserve router`) and the one-machine launcher (`deltaserve
serve-disagg`): an HTTP proxy that sends each request to a prefill instance, then to a decode instance with the
prefill's `kv_transfer_params`. It imports none of the engine."""
