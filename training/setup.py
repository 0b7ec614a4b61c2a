"""spec_edge_training: trains draft heads (EAGLE-3, Medusa, P-EAGLE) and small draft models for spec_edge,
as its own package: the serving install (ros/spec_edge) and the robot image do without it.

spec_edge_training/ here is a link to the repository root's (as ros/spec_edge/ links spec_edge/).
pip: `pip install -e training` (scripts/setup.sh does, with --no-deps: the pins are requirements.txt's).
"""
from setuptools import find_packages, setup

setup(
    name="spec_edge_training",
    version="0.1.0",
    packages=find_packages(include=["spec_edge_training", "spec_edge_training.*"]),
    install_requires=["spec_edge", "numpy", "torch", "transformers", "gguf", "safetensors"],
    description="Training of spec_edge's draft heads and draft models on the target's own outputs",
    license="Apache-2.0",
    entry_points={"console_scripts": ["spec-edge-train = spec_edge_training.train:main"]},
)
