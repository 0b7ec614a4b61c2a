"""The graph pipeline: the static Llama-family model, checkpoint reading, ONNX export, the tensor
names every graph shares, and the ONNX Runtime post-export passes (fused attention, 4-bit weights).

May import: config only.
"""
