"""Writers of what serving engines load directly: vLLM's pre-sharded (sharded_state) files."""
