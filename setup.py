"""megatron-delta: Delta Attention Residuals for Megatron-Core."""
from setuptools import find_packages, setup

setup(
    name="megatron-delta",
    version="0.1.0",
    description="Delta Attention Residuals (arXiv 2605.18855) for Megatron-Core TP/SP/PP pretraining",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_delta", "megatron_delta.*"]),
    package_data={"megatron_delta.core": ["csrc/*.c"]},  # the router's CPU kernels, compiled on first use
    install_requires=["torch>=2.4", "megatron-core>=0.19.2,<0.20", "sentencepiece", "numpy", "psutil"],
    extras_require={
        "test": ["pytest", "matplotlib", "tensorboard", "transformers>=5.0", "safetensors"],
        # GPU clusters only: never install on a CPU machine (it breaks Megatron's CPU path).
        "te": ["transformer-engine[pytorch]"],
        # GPU clusters: the router's fused kernel (fla-core's fused_attnres; --delta-router-kernels fla / auto).
        "gpu": ["fla-core==0.6.0"],
    },
)
