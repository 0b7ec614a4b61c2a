"""What a request touches: the engine (request -> result), the speculative loop, sampling, the
tokenizer, the backends (ONNX Runtime; TensorRT through Edge-LLM) and the drafters.

May import: config, graphs, heads, device.
"""
