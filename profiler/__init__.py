"""autopar's profiler: capture a model (zoo, Hugging Face, ``file.py:factory``) on meta/fake tensors, group it into
layers with per-node FLOPs, bytes, saved activations and parameter ownership, and time layers on a local device.

Imports torch (and transformers for ``hf:`` models) only: it knows nothing of costs or plans.
"""
