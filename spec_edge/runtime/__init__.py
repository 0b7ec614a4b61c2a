"""What a request touches: the engine (request -> result), the speculative loop, sampling, the
tokenizer, the backends (ONNX Runtime; TensorRT through Edge-LLM) and the drafters. It loads what the build made
(spec_edge/artifacts.py, `spec-edge build`) and makes no model file: no import of device/, graphs.export,
graphs.quantize or graphs.ort_attention (the plan and the folders' names: graphs/plan.py).

May import: config, speculation_policy, edgellm_layout, graphs, heads.
"""
