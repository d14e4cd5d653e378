from setuptools import find_packages, setup

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
    install_requires=["torch>=2.4"],
    extras_require={"test": ["pytest>=7", "expecttest>=0.2"]},
)
