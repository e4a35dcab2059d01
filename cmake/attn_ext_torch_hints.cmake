# attn_ext: what a CUDA build of torch needs found before find_package(Torch),
# found the way setup.py finds it, for attn_ext's own build and for the programs
# that find_package(attn_ext): the CUDA toolkit from nvcc itself (nvcc may be a
# wrapper script whose folder is not the toolkit's), nvrtc from the pip package
# `nvidia` beside torch, and TORCH_CUDA_ARCH_LIST (default "8.0;9.0", which
# torch's CMake turns into nvcc's -gencode flags). Each is left alone when the
# user has set it (CUDAToolkit_ROOT or CUDA_HOME, CUDA_nvrtc_LIBRARY,
# TORCH_CUDA_ARCH_LIST). With a CPU-only torch none of it is used.
find_file(ATTN_EXT_TORCH_CONFIG TorchConfig.cmake PATHS ${CMAKE_PREFIX_PATH} PATH_SUFFIXES Torch NO_DEFAULT_PATH)
if(ATTN_EXT_TORCH_CONFIG)
  # .../site-packages/torch/share/cmake/Torch/TorchConfig.cmake -> .../site-packages
  get_filename_component(ATTN_EXT_SITE_PACKAGES "${ATTN_EXT_TORCH_CONFIG}/../../../../.." ABSOLUTE)
endif()
find_program(ATTN_EXT_NVCC nvcc)
if(NOT ATTN_EXT_WITH_CUDA STREQUAL "OFF" AND ATTN_EXT_NVCC AND NOT CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDA_HOME})
  execute_process(COMMAND "${ATTN_EXT_NVCC}" --dryrun -x cu -c /dev/null
                  OUTPUT_VARIABLE dry_out ERROR_VARIABLE dry_err TIMEOUT 60)
  if("${dry_out}${dry_err}" MATCHES "#\\$ TOP=([^\n]+)")
    get_filename_component(ATTN_EXT_CUDA_TOP "${CMAKE_MATCH_1}" REALPATH)
    set(CUDAToolkit_ROOT "${ATTN_EXT_CUDA_TOP}")
    set(CUDA_TOOLKIT_ROOT_DIR "${ATTN_EXT_CUDA_TOP}" CACHE PATH "the CUDA toolkit")
    set(CMAKE_CUDA_COMPILER "${ATTN_EXT_CUDA_TOP}/bin/nvcc" CACHE FILEPATH "nvcc")
  endif()
endif()
if(ATTN_EXT_SITE_PACKAGES AND NOT CUDA_nvrtc_LIBRARY)
  file(GLOB ATTN_EXT_NVRTC "${ATTN_EXT_SITE_PACKAGES}/nvidia/cu*/lib/libnvrtc.so*"
                           "${ATTN_EXT_SITE_PACKAGES}/nvidia/cuda_nvrtc/lib/libnvrtc.so*")
  if(ATTN_EXT_NVRTC)
    list(SORT ATTN_EXT_NVRTC)
    list(GET ATTN_EXT_NVRTC 0 nvrtc)
    set(CUDA_nvrtc_LIBRARY "${nvrtc}" CACHE FILEPATH "libnvrtc")
  endif()
endif()
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "8.0;9.0")  # torch's CMake turns it into nvcc's -gencode flags
endif()

