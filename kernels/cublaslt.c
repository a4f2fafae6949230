/* cuBLASLt opened with dlopen: function table, one handle per device, and a
 * cache of the heuristic's algorithm per problem (see cublaslt.h). */
#define _GNU_SOURCE
#include "cublaslt.h"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CQ_LT_MAX_DEVICES 64
#define CQ_LT_CACHE_SIZE 512

/* The entry points libcquant uses, typed from cublasLt.h's own prototypes. */
typedef struct lt_api {
  __typeof__(&cublasLtGetVersion) GetVersion;
  __typeof__(&cublasLtCreate) Create;
  __typeof__(&cublasLtMatmulDescCreate) MatmulDescCreate;
  __typeof__(&cublasLtMatmulDescDestroy) MatmulDescDestroy;
  __typeof__(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  __typeof__(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  __typeof__(&cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
  __typeof__(&cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  __typeof__(&cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  __typeof__(&cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  __typeof__(&cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  __typeof__(&cublasLtMatmul) Matmul;
} lt_api;

static pthread_mutex_t lt_mutex = PTHREAD_MUTEX_INITIALIZER;
static lt_api api;
static int api_state; /* 0 not tried, 1 loaded, -1 failed */
static size_t api_version;
static char load_error[1536];
static cublasLtHandle_t handles[CQ_LT_MAX_DEVICES];

/* ---- loading ---- */

static const char *status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

/* Record a failed cuBLASLt call with its status, file and line. */
#define LT_FAIL(what, s) \
  cq_fail(CQ_ERR_CUBLAS, "%s failed: %s (%d) (%s:%d)", what, status_name(s), (int)(s), __FILE__, __LINE__)

#define LT_CHECK(call, what)                        \
  do {                                              \
    cublasStatus_t lt_s_ = (call);                  \
    if (lt_s_ != CUBLAS_STATUS_SUCCESS) {           \
      st = LT_FAIL(what, lt_s_);                    \
      goto done;                                    \
    }                                               \
  } while (0)

static int resolve(void *lib) {
#define RESOLVE(field, sym)                             \
  do {                                                  \
    *(void **)(&api.field) = dlsym(lib, #sym);          \
    if (!api.field) {                                   \
      snprintf(load_error, sizeof load_error, "%s has no symbol %s", "libcublasLt", #sym); \
      return 0;                                         \
    }                                                   \
  } while (0)
  RESOLVE(GetVersion, cublasLtGetVersion);
  RESOLVE(Create, cublasLtCreate);
  RESOLVE(MatmulDescCreate, cublasLtMatmulDescCreate);
  RESOLVE(MatmulDescDestroy, cublasLtMatmulDescDestroy);
  RESOLVE(MatmulDescSetAttribute, cublasLtMatmulDescSetAttribute);
  RESOLVE(MatrixLayoutCreate, cublasLtMatrixLayoutCreate);
  RESOLVE(MatrixLayoutDestroy, cublasLtMatrixLayoutDestroy);
  RESOLVE(MatmulPreferenceCreate, cublasLtMatmulPreferenceCreate);
  RESOLVE(MatmulPreferenceDestroy, cublasLtMatmulPreferenceDestroy);
  RESOLVE(MatmulPreferenceSetAttribute, cublasLtMatmulPreferenceSetAttribute);
  RESOLVE(MatmulAlgoGetHeuristic, cublasLtMatmulAlgoGetHeuristic);
  RESOLVE(Matmul, cublasLtMatmul);
#undef RESOLVE
  return 1;
}

/* Append candidate `path` to the tried list; open it if it exists. */
static void *try_open(const char *path, char *tried, size_t cap) {
  size_t used = strlen(tried);
  if (used + strlen(path) + 3 < cap) snprintf(tried + used, cap - used, "%s%s", used ? ", " : "", path);
  return dlopen(path, RTLD_NOW | RTLD_LOCAL);
}

/* A directory or a file: directories get the versioned file name appended. */
static void *try_open_dir_or_file(const char *where, const char *soname, char *tried, size_t cap) {
  char path[1024];
  size_t n = strlen(where);
  if (n == 0 || n > 900) return NULL;
  if (n > 3 && strstr(where, ".so")) return try_open(where, tried, cap);
  snprintf(path, sizeof path, "%s/%s", where, soname);
  return try_open(path, tried, cap);
}

static void load_locked(void) {
  char soname[64], tried[1024] = "";
  snprintf(soname, sizeof soname, "libcublasLt.so.%d", CUDART_VERSION / 1000);
  void *lib = try_open(soname, tried, sizeof tried);
  const cq_settings settings = cq_settings_now();
  const char *env = settings.cublaslt_path; /* files or directories, ':'-separated */
  while (!lib && env && *env) {
    const char *end = strchr(env, ':');
    size_t len = end ? (size_t)(end - env) : strlen(env);
    char one[1024];
    if (len > 0 && len < sizeof one) {
      memcpy(one, env, len);
      one[len] = '\0';
      lib = try_open_dir_or_file(one, soname, tried, sizeof tried);
    }
    env = end ? end + 1 : NULL;
  }
  const char *homes[2] = {getenv("CUDA_HOME"), "/usr/local/cuda"};
  for (int h = 0; h < 2 && !lib; ++h) {
    if (!homes[h]) continue;
    char dir[960];
    snprintf(dir, sizeof dir, "%s/lib64", homes[h]);
    lib = try_open_dir_or_file(dir, soname, tried, sizeof tried);
    if (!lib) {
      snprintf(dir, sizeof dir, "%s/lib", homes[h]);
      lib = try_open_dir_or_file(dir, soname, tried, sizeof tried);
    }
  }
  if (!lib) {
    snprintf(load_error, sizeof load_error,
             "cuBLASLt (%s) was not found; tried %s. Install the nvidia-cublas wheel or a CUDA %d toolkit, "
             "or set CQUANT_CUBLASLT_PATH to the library or its directory", soname, tried, CUDART_VERSION / 1000);
    api_state = -1;
    return;
  }
  if (!resolve(lib)) {
    api_state = -1;
    return;
  }
  api_version = api.GetVersion();
  if (api_version / 10000 != (size_t)(CUDART_VERSION / 1000)) {
    snprintf(load_error, sizeof load_error, "cuBLASLt %zu was found, but libcquant was built for cuBLASLt %d.x",
             api_version, CUDART_VERSION / 1000);
    api_state = -1;
    return;
  }
  api_state = 1;
}

cq_status cq_lt_describe(size_t *version, char *path, size_t path_cap, char *error, size_t error_cap) {
  size_t v = 0;
  const cq_status st = cq_lt_load(&v);
  *version = st == CQ_OK ? v : 0;
  path[0] = error[0] = '\0';
  if (st != CQ_OK) {
    snprintf(error, error_cap, "%s", cq_last_error());
    return CQ_OK;
  }
  Dl_info info;
  if (dladdr(*(void **)&api.GetVersion, &info) && info.dli_fname) snprintf(path, path_cap, "%s", info.dli_fname);
  return CQ_OK;
}

cq_status cq_lt_load(size_t *version) {
  pthread_mutex_lock(&lt_mutex);
  if (api_state == 0) load_locked();
  int ok = api_state == 1;
  if (version) *version = api_version;
  pthread_mutex_unlock(&lt_mutex);
  if (!ok) return cq_fail(CQ_ERR_UNSUPPORTED, "%s", load_error);
  return CQ_OK;
}

static cq_status get_handle(int device, cublasLtHandle_t *out) {
  if (device < 0 || device >= CQ_LT_MAX_DEVICES)
    return cq_fail(CQ_ERR_UNSUPPORTED, "cuBLASLt: device %d is beyond the %d devices libcquant handles", device,
                   CQ_LT_MAX_DEVICES);
  cq_status st = CQ_OK;
  pthread_mutex_lock(&lt_mutex);
  if (!handles[device]) {
    cublasStatus_t s = api.Create(&handles[device]); /* the caller made `device` current */
    if (s != CUBLAS_STATUS_SUCCESS) {
      handles[device] = NULL;
      st = LT_FAIL("cublasLtCreate", s);
    }
  }
  *out = handles[device];
  pthread_mutex_unlock(&lt_mutex);
  return st;
}

/* ---- algorithm cache ---- */

typedef struct algo_key {
  int64_t m, n, k, lda, ldb, ldd, ldc;
  int32_t a_type, b_type, d_type, bias_type, trans_a, trans_b, scale_mode, device, has_bias, gelu, has_c, c_is_d;
  uint32_t align_a, align_b, align_d, align_bias, align_c;
  uint64_t workspace_bytes;
} algo_key;

typedef struct algo_entry {
  algo_key key;
  cublasLtMatmulAlgo_t algo;
  int used;
  int found; /* 0: cuBLASLt has no algorithm for this problem */
} algo_entry;

static algo_entry cache[CQ_LT_CACHE_SIZE];
static int cache_next;

static int cache_find(const algo_key *key, cublasLtMatmulAlgo_t *algo, int *found) {
  int hit = 0;
  pthread_mutex_lock(&lt_mutex);
  for (int i = 0; i < CQ_LT_CACHE_SIZE && cache[i].used; ++i) {
    if (memcmp(&cache[i].key, key, sizeof *key) == 0) {
      *algo = cache[i].algo;
      *found = cache[i].found;
      hit = 1;
      break;
    }
  }
  pthread_mutex_unlock(&lt_mutex);
  return hit;
}

static void cache_put(const algo_key *key, const cublasLtMatmulAlgo_t *algo, int found) {
  pthread_mutex_lock(&lt_mutex);
  algo_entry *e = &cache[cache_next];
  cache_next = (cache_next + 1) % CQ_LT_CACHE_SIZE; /* oldest first when full */
  e->key = *key;
  if (algo) e->algo = *algo;
  e->found = found;
  e->used = 1;
  pthread_mutex_unlock(&lt_mutex);
}

/* Largest power of two (<= 256) that divides the address. */
static uint32_t alignment_of(const void *p) {
  uintptr_t a = (uintptr_t)p;
  uint32_t al = 256;
  while (al > 1 && (a & (al - 1))) al >>= 1;
  return al;
}

static cudaDataType_t cuda_type(cq_dtype d) {
  switch (d) {
    case CQ_DTYPE_F32: return CUDA_R_32F;
    case CQ_DTYPE_F16: return CUDA_R_16F;
    case CQ_DTYPE_BF16: return CUDA_R_16BF;
    case CQ_DTYPE_F8_E4M3FN: return CUDA_R_8F_E4M3;
    case CQ_DTYPE_F8_E5M2: return CUDA_R_8F_E5M2;
    default: return CUDA_R_32F;
  }
}

/* ---- one GEMM ---- */

cq_status cq_lt_matmul(const cq_lt_gemm *g, void *stream) {
  CQ_TRY(cq_lt_load(NULL));
  if (g->scale_mode == CQ_LT_SCALE_OUTER_VEC && api_version < 120900)
    return cq_fail(CQ_ERR_UNSUPPORTED, "per-row fp8 scales need cuBLASLt 12.9 or newer (found %zu)", api_version);
  cublasLtHandle_t handle = NULL;
  CQ_TRY(get_handle(g->device, &handle));

  algo_key key;
  memset(&key, 0, sizeof key); /* padding takes part in memcmp */
  key.m = g->m, key.n = g->n, key.k = g->k, key.lda = g->lda, key.ldb = g->ldb, key.ldd = g->ldd;
  key.a_type = g->a_type, key.b_type = g->b_type, key.d_type = g->d_type, key.bias_type = g->bias_type;
  key.trans_a = !!g->trans_a, key.trans_b = !!g->trans_b, key.scale_mode = g->scale_mode, key.device = g->device;
  key.has_bias = g->bias != NULL;
  key.gelu = !!g->gelu;
  key.align_a = alignment_of(g->a), key.align_b = alignment_of(g->b), key.align_d = alignment_of(g->d);
  key.align_bias = g->bias ? alignment_of(g->bias) : 0;
  key.has_c = g->c != NULL;
  key.c_is_d = g->c == g->d;
  key.ldc = g->c ? g->ldc : 0;
  key.align_c = g->c ? alignment_of(g->c) : 0;
  key.workspace_bytes = g->workspace ? g->workspace_bytes : 0;

  cq_status st = CQ_OK;
  cublasLtMatmulDesc_t op = NULL;
  cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL, lc = NULL;
  cublasLtMatmulPreference_t pref = NULL;

  LT_CHECK(api.MatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  int32_t ta = g->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_CHECK(api.MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "set TRANSA");
  LT_CHECK(api.MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "set TRANSB");
  if (g->bias || g->gelu) {
    uint32_t epi = g->bias ? (g->gelu ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_BIAS) : CUBLASLT_EPILOGUE_GELU;
    LT_CHECK(api.MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), "set EPILOGUE");
  }
  if (g->bias) {
    int32_t bt = (int32_t)cuda_type(g->bias_type);
    LT_CHECK(api.MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g->bias, sizeof g->bias),
             "set BIAS_POINTER");
    LT_CHECK(api.MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt),
             "set BIAS_DATA_TYPE");
  }
  if (g->scale_mode != CQ_LT_SCALE_NONE) {
    LT_CHECK(api.MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g->a_scale, sizeof g->a_scale),
             "set A_SCALE_POINTER");
    LT_CHECK(api.MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g->b_scale, sizeof g->b_scale),
             "set B_SCALE_POINTER");
    if (g->scale_mode == CQ_LT_SCALE_OUTER_VEC) {
      int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      LT_CHECK(api.MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode),
               "set A_SCALE_MODE");
      LT_CHECK(api.MatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode),
               "set B_SCALE_MODE");
    }
  }
  /* stored shapes: op(A) is m x k, so A is k x m when transposed */
  LT_CHECK(api.MatrixLayoutCreate(&la, cuda_type(g->a_type), g->trans_a ? g->k : g->m, g->trans_a ? g->m : g->k,
                                  g->lda), "cublasLtMatrixLayoutCreate(A)");
  LT_CHECK(api.MatrixLayoutCreate(&lb, cuda_type(g->b_type), g->trans_b ? g->n : g->k, g->trans_b ? g->k : g->n,
                                  g->ldb), "cublasLtMatrixLayoutCreate(B)");
  LT_CHECK(api.MatrixLayoutCreate(&ld, cuda_type(g->d_type), g->m, g->n, g->ldd), "cublasLtMatrixLayoutCreate(D)");
  if (g->c) /* C has D's type (cuBLASLt's rule for 16-bit and fp32 outputs) */
    LT_CHECK(api.MatrixLayoutCreate(&lc, cuda_type(g->d_type), g->m, g->n, g->ldc), "cublasLtMatrixLayoutCreate(C)");

  cublasLtMatmulAlgo_t algo;
  int found = 0;
  if (!cache_find(&key, &algo, &found)) {
    uint64_t ws = key.workspace_bytes;
    LT_CHECK(api.MatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    LT_CHECK(api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
             "set MAX_WORKSPACE_BYTES");
    LT_CHECK(api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a,
                                              sizeof key.align_a), "set MIN_ALIGNMENT_A_BYTES");
    LT_CHECK(api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b,
                                              sizeof key.align_b), "set MIN_ALIGNMENT_B_BYTES");
    const uint32_t align_c = g->c ? key.align_c : key.align_d;
    LT_CHECK(api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                              sizeof align_c), "set MIN_ALIGNMENT_C_BYTES");
    LT_CHECK(api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_d,
                                              sizeof key.align_d), "set MIN_ALIGNMENT_D_BYTES");
    /* split-K partial sums reduced in fp32 or not split at all: "in place" and output-type
     * reductions add the partials in D's type, a rounding per partial for 16-bit D, which the
     * documented math (fp32 sums, rounded once) does not have */
    const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    LT_CHECK(api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                              sizeof reductions), "set REDUCTION_SCHEME_MASK");
    cublasLtMatmulHeuristicResult_t result;
    int count = 0;
    memset(&result, 0, sizeof result);
    cublasStatus_t s = api.MatmulAlgoGetHeuristic(handle, op, la, lb, lc ? lc : ld, ld, pref, 1, &result, &count);
    if (s == CUBLAS_STATUS_SUCCESS && count > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
      algo = result.algo;
      found = 1;
      cache_put(&key, &algo, 1);
    } else if (s == CUBLAS_STATUS_SUCCESS || s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_INVALID_VALUE) {
      cache_put(&key, NULL, 0); /* ask once: the answer does not change */
    } else {
      st = LT_FAIL("cublasLtMatmulAlgoGetHeuristic", s);
      goto done;
    }
  }
  if (!found) {
    st = cq_fail(CQ_ERR_UNSUPPORTED,
                 "cuBLASLt %zu has no algorithm for a %s x %s -> %s GEMM of m=%lld n=%lld k=%lld (lda=%lld ldb=%lld "
                 "ldd=%lld, scale mode %d, bias %s%s%s) on device %d",
                 api_version, cq_dtype_name(g->a_type), cq_dtype_name(g->b_type), cq_dtype_name(g->d_type),
                 (long long)g->m, (long long)g->n, (long long)g->k, (long long)g->lda, (long long)g->ldb,
                 (long long)g->ldd, (int)g->scale_mode, g->bias ? cq_dtype_name(g->bias_type) : "none", g->gelu ? ", GELU" : "",
                 g->c ? ", + C" : "", g->device);
    goto done;
  }
  {
    const float alpha = 1.0f, beta = g->c ? 1.0f : 0.0f;
    LT_CHECK(api.Matmul(handle, op, &alpha, g->a, la, g->b, lb, &beta, g->c ? g->c : g->d, lc ? lc : ld, g->d, ld,
                        &algo, key.workspace_bytes ? g->workspace : NULL, key.workspace_bytes, (cudaStream_t)stream),
             "cublasLtMatmul");
  }
done:
  if (pref) api.MatmulPreferenceDestroy(pref);
  if (lc) api.MatrixLayoutDestroy(lc);
  if (ld) api.MatrixLayoutDestroy(ld);
  if (lb) api.MatrixLayoutDestroy(lb);
  if (la) api.MatrixLayoutDestroy(la);
  if (op) api.MatmulDescDestroy(op);
  return st;
}
