"""ament_python package spec_edge (colcon build) and a plain pip-installable Python package.

It lives in ros/spec_edge/, not at the repository root: colcon stops descending into a folder once
it has found a package there, so a package at the root would hide spec_edge_interfaces/ beside it.
spec_edge/, launch/ and config/ here are links to the root's. pip: `pip install -e ros/spec_edge`.
"""
from glob import glob

from setuptools import find_packages, setup

PACKAGE = "spec_edge"

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.launch.py")),
        (f"share/{PACKAGE}/config", glob("config/*.yaml")),
    ],
    install_requires=["setuptools", "numpy", "pyyaml", "jinja2", "onnxruntime", "onnx", "tokenizers", "llguidance"],
    extras_require={
        "export": ["torch", "onnxscript", "transformers", "gguf", "accelerate", "safetensors"],
    },
    zip_safe=True,
    maintainer="spec_edge developers",
    maintainer_email="dev@spec-edge.invalid",
    description="Local speculative-decoding text generation for robots (ROS 2)",
    license="Apache-2.0",
    entry_points={
        "console_scripts": [
            "spec-edge = spec_edge.cli:main",
            "generate_server = spec_edge.ros2.node:main",
            "build_engines = spec_edge.device.commands:build_engines_main",
        ],
    },
)
