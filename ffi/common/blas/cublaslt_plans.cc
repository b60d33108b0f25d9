// cuBLASLt handles and matmul plans (cublaslt_plans.h).
#include "common/blas/cublaslt_plans.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/blas/cublaslt_tuning.h"

namespace jaxgpu::blas {

bool GemmKey::operator==(const GemmKey& o) const {
  return device == o.device && m == o.m && n == o.n && k == o.k && batch == o.batch &&
         trans_a == o.trans_a && trans_b == o.trans_b && a_type == o.a_type && b_type == o.b_type &&
         c_type == o.c_type && d_type == o.d_type && compute == o.compute &&
         epilogue == o.epilogue && has_bias == o.has_bias &&
         (!has_bias || bias_type == o.bias_type) && has_aux == o.has_aux &&
         (!has_aux || aux_type == o.aux_type) && workspace_bytes == o.workspace_bytes &&
         alignment == o.alignment && lda == o.lda && ldb == o.ldb && ldd == o.ldd;
}

namespace {

struct GemmKeyHash {
  size_t operator()(const GemmKey& key) const {
    size_t h = 0;
    auto mix = [&h](int64_t v) {
      h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    };
    mix(key.device);
    mix(key.m);
    mix(key.n);
    mix(key.k);
    mix(key.batch);
    mix((int64_t(key.trans_a) << 1) | int64_t(key.trans_b));
    mix((int64_t(key.a_type) << 24) | (int64_t(key.b_type) << 16) | (int64_t(key.c_type) << 8) |
        int64_t(key.d_type));
    mix(key.compute);
    mix(key.epilogue);
    mix((int64_t(key.has_bias) << 1) | int64_t(key.has_aux));
    mix(key.workspace_bytes);
    mix(key.alignment);
    mix(key.lda);
    mix(key.ldb);
    mix(key.ldd);
    return h;
  }
};

std::string LtError(const char* what, cublasStatus_t s) {
  return std::string("cuBLASLt ") + what + ": " + cublasLtGetStatusName(s) + " (" +
         cublasLtGetStatusString(s) + ")";
}

// The descriptors of one plan; the heuristic's answers for them and the one that runs: the
// first answer until the first call times them all (cublaslt_tuning.h).
struct Plan : PlanDescriptors {
  std::vector<cublasLtMatmulAlgo_t> candidates;
  cublasLtMatmulAlgo_t algo{};
  bool tuned = false;
  // Calls set the per-call pointers (bias, aux, scales) on `desc`: one call at a time.
  std::mutex mu;
};

class Cache {
 public:
  static Cache& Get() {
    static Cache* cache = new Cache();  // never destroyed: see the header
    return *cache;
  }

  Status Handle(int device, cublasLtHandle_t* out) {
    std::lock_guard<std::mutex> lock(mu_);
    return HandleLocked(device, out);
  }

  // The plan of `key`, built on first use. The pointer stays valid for the process.
  Status FindPlan(const GemmKey& key, cublasLtHandle_t* handle, Plan** plan) {
    std::lock_guard<std::mutex> lock(mu_);
    if (Status s = HandleLocked(key.device, handle); !s.ok()) return s;
    auto it = plans_.find(key);
    if (it != plans_.end()) {
      *plan = it->second.get();
      return Status::Ok();
    }
    auto made = std::make_unique<Plan>();
    if (Status s = Build(key, *handle, made.get()); !s.ok()) {
      Destroy(made.get());
      return s;
    }
    *plan = made.get();
    plans_.emplace(key, std::move(made));
    return Status::Ok();
  }

  size_t PlanCount() {
    std::lock_guard<std::mutex> lock(mu_);
    return plans_.size();
  }

 private:
  Status HandleLocked(int device, cublasLtHandle_t* out) {
    auto it = handles_.find(device);
    if (it != handles_.end()) {
      *out = it->second;
      return Status::Ok();
    }
    cublasLtHandle_t h = nullptr;
    if (cublasStatus_t s = cublasLtCreate(&h); s != CUBLAS_STATUS_SUCCESS) {
      return Status::Error(LtError("handle creation", s));
    }
    handles_.emplace(device, h);
    *out = h;
    return Status::Ok();
  }

  static Status Build(const GemmKey& key, cublasLtHandle_t handle, Plan* p) {
    cudaDataType_t at, bt, ct, dt;
    if (!ToCudaDataType(key.a_type, &at) || !ToCudaDataType(key.b_type, &bt) ||
        !ToCudaDataType(key.c_type, &ct) || !ToCudaDataType(key.d_type, &dt)) {
      return Status::Error("cuBLASLt: an operand dtype has no cuBLASLt type");
    }
    const cudaDataType_t scale =
        key.compute == CUBLAS_COMPUTE_32I || key.compute == CUBLAS_COMPUTE_32I_PEDANTIC
            ? CUDA_R_32I
            : CUDA_R_32F;
    cublasStatus_t s = cublasLtMatmulDescCreate(&p->desc, key.compute, scale);
    if (s != CUBLAS_STATUS_SUCCESS) return Status::Error(LtError("matmul descriptor", s));
    const cublasOperation_t ta = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t bytes) {
      if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(p->desc, attr, v, bytes);
    };
    set(CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    set(CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    set(CUBLASLT_MATMUL_DESC_EPILOGUE, &key.epilogue, sizeof(key.epilogue));
    if (key.has_bias) {
      cudaDataType_t bias;
      if (!ToCudaDataType(key.bias_type, &bias)) {
        return Status::Error("cuBLASLt: the bias dtype has no cuBLASLt type");
      }
      set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias, sizeof(bias));
    }
    if (key.has_aux) {
      cudaDataType_t aux;
      if (!ToCudaDataType(key.aux_type, &aux)) {
        return Status::Error("cuBLASLt: the aux dtype has no cuBLASLt type");
      }
      const int64_t ld = key.m;
      set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &aux, sizeof(aux));
      set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld));
    }
    if (s != CUBLAS_STATUS_SUCCESS) return Status::Error(LtError("matmul attributes", s));

    // Column-major layouts, as stored: A is m x k (k x m when transposed), etc.; packed
    // unless the key gives a leading dimension.
    if (key.batch > 1 && (key.lda || key.ldb || key.ldd)) {
      return Status::Error("cuBLASLt: leading dimensions with batch > 1 are not supported");
    }
    auto layout = [&](cublasLtMatrixLayout_t* l, cudaDataType_t t, int64_t rows, int64_t cols,
                      int64_t ld) {
      if (s != CUBLAS_STATUS_SUCCESS) return;
      s = cublasLtMatrixLayoutCreate(l, t, rows, cols, ld ? ld : rows);
      if (s == CUBLAS_STATUS_SUCCESS && key.batch > 1) {
        const int32_t count = static_cast<int32_t>(key.batch);
        const int64_t stride = rows * cols;
        s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                             sizeof(count));
        if (s == CUBLAS_STATUS_SUCCESS) {
          s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                               &stride, sizeof(stride));
        }
      }
    };
    layout(&p->a, at, key.trans_a ? key.k : key.m, key.trans_a ? key.m : key.k, key.lda);
    layout(&p->b, bt, key.trans_b ? key.n : key.k, key.trans_b ? key.k : key.n, key.ldb);
    layout(&p->c, ct, key.m, key.n, key.ldd);
    layout(&p->d, dt, key.m, key.n, key.ldd);
    if (s != CUBLAS_STATUS_SUCCESS) return Status::Error(LtError("matrix layouts", s));

    cublasLtMatmulPreference_t pref = nullptr;
    s = cublasLtMatmulPreferenceCreate(&pref);
    if (s != CUBLAS_STATUS_SUCCESS) return Status::Error(LtError("preference", s));
    const uint64_t workspace = static_cast<uint64_t>(key.workspace_bytes);
    const uint32_t align = static_cast<uint32_t>(key.alignment);
    auto pref_set = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, size_t bytes) {
      if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, attr, v, bytes);
    };
    pref_set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align, sizeof(align));
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align, sizeof(align));
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align, sizeof(align));
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align, sizeof(align));
    std::vector<cublasLtMatmulHeuristicResult_t> results(CandidateCount());
    int found = 0;
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->a, p->b, p->c, p->d, pref,
                                         static_cast<int>(results.size()), results.data(), &found);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS) return Status::Error(LtError("algorithm heuristic", s));
    for (int i = 0; i < found; ++i) {
      if (results[i].state == CUBLAS_STATUS_SUCCESS) p->candidates.push_back(results[i].algo);
    }
    if (p->candidates.empty()) {
      return Status::Error("cuBLASLt: no algorithm for this problem (m " + std::to_string(key.m) +
                           ", n " + std::to_string(key.n) + ", k " + std::to_string(key.k) +
                           ", workspace " + std::to_string(key.workspace_bytes) +
                           " bytes, alignment " + std::to_string(key.alignment) + ")");
    }
    p->algo = p->candidates[0];
    return Status::Ok();
  }

  static void Destroy(Plan* p) {
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->c) cublasLtMatrixLayoutDestroy(p->c);
    if (p->d) cublasLtMatrixLayoutDestroy(p->d);
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
  }

  std::mutex mu_;
  std::unordered_map<int, cublasLtHandle_t> handles_;
  std::unordered_map<GemmKey, std::unique_ptr<Plan>, GemmKeyHash> plans_;
};

}  // namespace

int PointerAlignment(std::initializer_list<const void*> pointers) {
  int align = 256;
  for (const void* ptr : pointers) {
    if (ptr == nullptr) continue;
    const uintptr_t address = reinterpret_cast<uintptr_t>(ptr);
    while (align > 1 && address % align != 0) align /= 2;
  }
  return align;
}

bool ToCudaDataType(DType t, cudaDataType_t* out) {
  switch (t) {
    case DType::kF32: *out = CUDA_R_32F; return true;
    case DType::kBF16: *out = CUDA_R_16BF; return true;
    case DType::kF16: *out = CUDA_R_16F; return true;
    case DType::kS8: *out = CUDA_R_8I; return true;
    case DType::kU8: *out = CUDA_R_8U; return true;
    case DType::kS4: *out = CUDA_R_4I; return true;
    case DType::kF8E4M3: *out = CUDA_R_8F_E4M3; return true;
    case DType::kS32: *out = CUDA_R_32I; return true;
  }
  return false;
}

Status Handle(int device, cublasLtHandle_t* out) { return Cache::Get().Handle(device, out); }

Status Matmul(const GemmKey& key, const GemmOperands& ops, cudaStream_t stream) {
  if (key.has_bias != (ops.bias != nullptr) || key.has_aux != (ops.aux != nullptr)) {
    return Status::Error("cuBLASLt: bias / aux pointers do not match the plan");
  }
  if (key.workspace_bytes > 0 && ops.workspace == nullptr) {
    return Status::Error("cuBLASLt: the plan needs a workspace");
  }
  if (PointerAlignment({ops.a, ops.b, ops.c, ops.d}) < key.alignment) {
    return Status::Error("cuBLASLt: operands are less aligned than the plan assumes");
  }
  cublasLtHandle_t handle = nullptr;
  Plan* plan = nullptr;
  if (Status s = Cache::Get().FindPlan(key, &handle, &plan); !s.ok()) return s;

  std::lock_guard<std::mutex> lock(plan->mu);
  if (!plan->tuned) {
    plan->tuned = true;
    const int best = FastestCandidate(key, handle, *plan, plan->candidates);
    if (best >= 0) plan->algo = plan->candidates[best];
  }
  cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t bytes) {
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(plan->desc, attr, v, bytes);
  };
  if (key.has_bias) set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ops.bias, sizeof(ops.bias));
  if (key.has_aux) set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ops.aux, sizeof(ops.aux));
  set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ops.a_scale, sizeof(ops.a_scale));
  set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &ops.b_scale, sizeof(ops.b_scale));
  set(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &ops.d_scale, sizeof(ops.d_scale));
  if (s != CUBLAS_STATUS_SUCCESS) return Status::Error(LtError("call attributes", s));
  const void* c = ops.c != nullptr ? ops.c : ops.d;
  s = cublasLtMatmul(handle, plan->desc, ops.alpha, ops.a, plan->a, ops.b, plan->b, ops.beta, c,
                     plan->c, ops.d, plan->d, &plan->algo, ops.workspace,
                     static_cast<size_t>(key.workspace_bytes), stream);
  if (s != CUBLAS_STATUS_SUCCESS) return Status::Error(LtError("matmul", s));
  return Status::Ok();
}

size_t CachedPlanCount() { return Cache::Get().PlanCount(); }

}  // namespace jaxgpu::blas
