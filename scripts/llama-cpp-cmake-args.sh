#!/usr/bin/env bash
# CMake flags for building llama.cpp (llama-cpp-python) on this machine: the SIMD features
# the CPU reports, but never AMX. With GGML_NATIVE (the default) a CPU that lists amx_int8
# gets AMX kernels, and on VMs whose kernel does not grant AMX tile state the first matmul
# segfaults (seen on this project's machines); where the tile state is granted, the AMX Q8_0
# kernel of the llama.cpp that llama-cpp-python 0.3.36 vendors dies with SIGILL on `tilezero`.
set -euo pipefail
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }
args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
has avx && args+=" -DGGML_AVX=ON"
has avx2 && args+=" -DGGML_AVX2=ON"
has fma && args+=" -DGGML_FMA=ON"
has f16c && args+=" -DGGML_F16C=ON"
has bmi2 && args+=" -DGGML_BMI2=ON"
has avx_vnni && args+=" -DGGML_AVX_VNNI=ON"
has avx512f && args+=" -DGGML_AVX512=ON"
has avx512vbmi && args+=" -DGGML_AVX512_VBMI=ON"
has avx512_vnni && args+=" -DGGML_AVX512_VNNI=ON"
has avx512_bf16 && args+=" -DGGML_AVX512_BF16=ON"
echo "$args"
