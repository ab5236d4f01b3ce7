"""The SimPy simulator of a vLLM-like engine serving real-time sessions."""
