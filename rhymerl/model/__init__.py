"""The policy model: a Llama-family decoder that reads and writes Hugging Face folders."""
from rhymerl.model.checkpoint import hf_to_ours, load_pretrained, load_state_dict, ours_to_hf, save_pretrained
from rhymerl.model.config import ModelConfig
from rhymerl.model.llama import CacheView, CausalLM

__all__ = ["hf_to_ours", "ours_to_hf", "CacheView", "CausalLM", "ModelConfig", "load_pretrained", "load_state_dict", "save_pretrained"]
