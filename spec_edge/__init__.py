"""spec_edge: speculative decoding for robots, one room per concern.

    config.py   the YAML profiles as frozen dataclasses (imports nothing of spec_edge)
    graphs/     model, weights, ONNX export and the post-export passes   (ONNX in, ONNX out)
    heads/      draft-head architectures, checkpoint layouts, head graphs
    device/     TensorRT engine builds, manifests and the Thor memory plan
    runtime/    what a request touches: engine, speculative loop, sampling, backends, drafters
    tools/      spec-edge bench (this engine against itself)
    ros2/       the ROS 2 node and client
    cli.py      the spec-edge command

Imports run one way: graphs <- heads <- device <- runtime <- (tools, ros2) <- cli, each
room also using config (test/test_layout.py holds the rule). Training is its own package beside this
one (spec_edge_training/, console script spec-edge-train); the comparisons with peer engines are
scripts in bench/.
"""
