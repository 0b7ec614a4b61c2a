"""Image input for a vision target (docs/images.md): the image processor and prompt expansion (processor.py), the
encoder graph's runner with its output cache (encoder.py). The export of the encoder: spec_edge/graphs/vision.py."""
