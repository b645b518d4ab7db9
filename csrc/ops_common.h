// Shared by the CPU and CUDA op implementations: input validation and the
// translation of torch tensors into the plain AttentionFwdParams /
// AttentionBwdParams structs that kernels consume. An umbrella over the headers
// that hold them, split by concern:
//   ops_checks.h   input validation (dtype / shape / device / stride, cu_seqlens,
//                  tuning arguments, dq_accum, partial-result tensors)
//   ops_params.h   tensors -> params structs (apply_* / make_* / fill_* / set_*)
//   ops_outputs.h  the lse allocation and the add into a caller's dq_accum
//   ops_sdpa.h     the SDPA-layout adapter of the sdpa_fwd operator
#pragma once
#include "ops_checks.h"
#include "ops_outputs.h"
#include "ops_params.h"
#include "ops_sdpa.h"
