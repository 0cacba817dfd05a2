from setuptools import find_packages, setup

setup(
    name="fastdeploy",
    version="0.1.0",
    description="OpenAI-compatible LLM serving engine with sampling masks, exact speculative logprobs "
    "and xgrammar structured output",
    packages=find_packages(include=["fastdeploy", "fastdeploy.*"]),
    package_data={"fastdeploy.model_executor.models": ["configs/*.json"]},
    python_requires=">=3.10",
    entry_points={"console_scripts": ["fastdeploy=fastdeploy.entrypoints.cli:main"]},
)
