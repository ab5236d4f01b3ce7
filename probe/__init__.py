"""The live probe: drives the real vLLM engine with paced real-time sessions (vLLM imported lazily)."""
