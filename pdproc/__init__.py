"""pdproc: an Envoy external processor for vLLM Mooncake prefill/decode disaggregation."""

__version__ = "0.1.0"
