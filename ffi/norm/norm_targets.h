// Handler symbols of the normalization family, registered by ffi/module_{cpu,cuda}.cc.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxgpuRmsNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxgpuLayerNormFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxgpuRmsNormBwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxgpuLayerNormBwdCpu);

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxgpuRmsNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxgpuLayerNormFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxgpuRmsNormBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxgpuLayerNormBwdCuda);
