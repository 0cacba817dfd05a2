import os

from setuptools import find_packages, setup


def ext_modules() -> tuple[list, dict]:
    """The packed step output ops (the CUDA one only where CUDA is there at build time) and the CPU
    kernels (GGUF block matmuls, fused decode ops).

    Without torch in the build environment (an isolated build) nothing is compiled:
    fastdeploy.ops then builds the ops just in time on first use.
    """
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        return [], {}
    include = [os.path.abspath("custom_ops")]
    modules = [CppExtension("fastdeploy.ops._step_packer_cpu", ["custom_ops/step_packer.cpp"],
                            include_dirs=include, extra_compile_args=["-O3"]),
               # OpenMP: at::parallel_for in these kernels runs on one thread without it.
               CppExtension("fastdeploy.ops._cpu_kernels",
                            ["custom_ops/gguf_matmul_cpu.cpp", "custom_ops/cpu_decode_ops.cpp"],
                            include_dirs=include, extra_compile_args=["-O3", "-fopenmp"],
                            extra_link_args=["-fopenmp"])]
    if torch.version.cuda is not None and CUDA_HOME is not None and torch.cuda.is_available():
        modules.append(CUDAExtension("fastdeploy.ops._step_packer_cuda", ["custom_ops/step_packer_cuda.cu"],
                                     include_dirs=include, extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]}))
    return modules, {"build_ext": BuildExtension}


modules, cmdclass = ext_modules()

setup(
    name="fastdeploy",
    version="0.1.0",
    description="OpenAI-compatible LLM serving engine with sampling masks, exact speculative logprobs "
    "and xgrammar structured output",
    packages=find_packages(include=["fastdeploy", "fastdeploy.*"]),
    package_data={"fastdeploy.model_executor.models": ["configs/*.json", "mtp_heads/*/*"]},
    python_requires=">=3.10",
    entry_points={"console_scripts": ["fastdeploy=fastdeploy.entrypoints.cli:main"]},
    ext_modules=modules,
    cmdclass=cmdclass,
)
