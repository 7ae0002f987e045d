"""Model loading: GGUF and safetensors weights, tokenizers, the packaged-model registry."""
