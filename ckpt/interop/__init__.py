"""Interoperability: export to Hugging Face safetensors or one torch file, and a
``save_pretrained`` directory as a starting point."""
