"""Input and output: a saved model's `config.json` (`pretrained`), recurrent states and atomic writes in safetensors
(`state`), and the classes other libraries load a saved model through: Hugging Face `transformers` (`hf`) and
EleutherAI's lm-evaluation-harness (`harness`), each imported by name since each needs its extra."""
