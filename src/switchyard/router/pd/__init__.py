"""Disaggregated serving: prefill/decode (vLLM and SGLang flows) and encode/prefill/decode."""
