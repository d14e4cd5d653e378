from setuptools import find_packages, setup

# The dependencies, as plain literals: tests/test_dependencies.py reads them (without running
# this file) and checks every import of the library, tests, examples and benchmark against them.
INSTALL_REQUIRES = ["torch>=2.4"]
EXTRAS_REQUIRE = {
    # torch.distributed.checkpoint (sharded checkpoints) needs NumPy on more than one rank, and
    # torch does not install it.
    "checkpoint": ["numpy"],
    "test": ["pytest>=7", "expecttest>=0.2", "numpy"],
    # Hugging Face models (tests/test_hf.py, examples/finetune_hf.py). transformers does not
    # require torch, so it never replaces the torch build already installed. safetensors: only
    # to cross-check flatshard's own reader against the package's files
    # (tests/test_pure_checkpoint_readers.py); load_pretrained does not need it.
    "hf": ["transformers>=5.0", "safetensors"],
    # The framework flows (tests/test_framework_*.py, docs/frameworks.md): Hugging Face
    # accelerate and Trainer, and Lightning, building flatshard's wrapper after
    # flatshard.patch_torch_fsdp(). None of them pins torch, so the build installed stays.
    "frameworks": ["transformers>=5.0", "accelerate>=1.0", "lightning>=2.4"],
    # The benchmark's DeepSpeed ZeRO-3 row (bench/bench.py --variants ...,deepspeed). DeepSpeed
    # requires torch unpinned, so the torch build already installed stays.
    "deepspeed": ["deepspeed>=0.19"],
}

setup(
    name="flatshard",
    version="0.1.0.dev0",
    description=(
        "Fully sharded data parallel training for PyTorch in the style of FSDP1: "
        "flat parameters, sharded over ranks, gathered just in time."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["flatshard", "flatshard.*"]),
    python_requires=">=3.9",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
