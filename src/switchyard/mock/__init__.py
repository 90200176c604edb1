"""Mock engines: vLLM- and SGLang-shaped servers over a simulated engine core."""
