"""A compact paged-attention engine for Llama-family models (CPU, or CUDA when present)."""
from engine.llm import LLM, PromptError, RequestOutput, SamplingParams

__all__ = ["LLM", "PromptError", "RequestOutput", "SamplingParams"]
