"""Optional integrations with model frameworks (imported lazily; each needs its own extra).

* :mod:`rotationzoo.integrations.transformers`: load a local Hugging Face model directory or GGUF
  file and capture post-RoPE Q/K/V for calibration (``pip install rotationzoo[transformers]``).
"""
