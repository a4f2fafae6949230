/* The run-time switches of libcquant: every CQUANT_* environment variable the library reads is
 * read here, once (at the first call that needs one, or again on cq_settings_reload), into one
 * cq_settings; the rest of the library asks cq_settings_now(). The build's own switches
 * (CQUANT_CUDA, CQUANT_CUDA_ARCHS, ...) belong to setup.py, not here.
 *
 * | Variable                      | Values (anything else: the default)          | Effect |
 * |-------------------------------|----------------------------------------------|--------|
 * | `CQUANT_DISABLE_WGMMA`        | `1` (any value not starting with `0`)        | int8 GEMMs (int8dq) run the mma.sync kernel on sm_90a too, not the wgmma one |
 * | `CQUANT_DISABLE_CUBLASLT_FP8` | `1` (any value not starting with `0`)        | fp8 GEMMs (fp8dqrow, fp8dq) run cquant's mma.sync kernel instead of cuBLASLt |
 * | `CQUANT_WO_CHUNK_MB`          | a positive integer (default 128)             | weight-only layers with more than 16 rows of x: MiB of dequantized weight per GEMM chunk (sizes the workspace) |
 * | `CQUANT_GROUP4_DECODE_M`      | a positive integer (default: measured choice) | 4-bit weight-only layers with bf16/f16 x and at least this many rows: dequantized rows and cuBLASLt, not the mixed-input GEMM |
 * | `CQUANT_WO_DECODE_M`          | a positive integer (default: measured choice) | int8 / fp8 / fpX weight-only layers with bf16/f16 x and at least this many rows: decoded rows and cuBLASLt; fewer rows: the sm_90a mixed-input GEMM wherever it takes the layer |
 * | `CQUANT_WO_SPLIT_K`           | `0` (default `1`)                            | the sm_90a weight-only GEMM never splits K (default: the tiles of a last wave that leaves SMs idle are cut along K); with CQUANT_WO_DECODE_M above every batch, a row's result then does not depend on the other rows |
 * | `CQUANT_WO_CLUSTER_PAIRS`     | `0` (default `1`)                            | the sm_90a weight-only GEMM adds a tile cut in two along K through the workspace (default: where the grid allows, its two ranges run as a thread-block cluster of two CTAs and the sums cross through distributed shared memory: no workspace round trip, no counters to zero) |
 * | `CQUANT_GEMV_PERSISTENT`      | `0`, `1` (default: measured choice)          | weight-only layers with at most 16 rows of x: `0` never runs the persistent GEMV, `1` runs it for every shape it can take |
 * | `CQUANT_ATTN_SM90`            | `0`, `1` (default: measured choice)          | attention on sm_90a: `0` never runs the wgmma kernels, `1` runs them for every head dim they take |
 * | `CQUANT_ATTN_DISABLE`         | comma-separated `mma`, `sm90`, `int8`, `all` | attention kernels switched off: calls that would run them fail with NotImplementedError (the Python backend then falls back) |
 * | `CQUANT_CUBLASLT_PATH`        | files or directories, `:`-separated          | where to look for libcublasLt after the already-loaded one (read when cuBLASLt is first opened) |
 * | `CQUANT_SHARE_ACTIVATIONS`    | `0` (default `1`)                            | Python package: `0` makes every dynamic-scheme layer quantize its own input, even where layers of one attention module read the same tensor |
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cquant-impl.h"

static pthread_mutex_t settings_mutex = PTHREAD_MUTEX_INITIALIZER;
static cq_settings current;
static int loaded;

#define DEFAULT_WO_CHUNK_MIB 128

/* Set and not starting with '0'. */
static int env_flag(const char *name) {
  const char *v = getenv(name);
  return v && v[0] && v[0] != '0';
}

/* "0" -> 0, "1" -> 1, anything else (or unset) -> -1, the measured choice. */
static int env_tristate(const char *name) {
  const char *v = getenv(name);
  if (v && strcmp(v, "0") == 0) return 0;
  if (v && strcmp(v, "1") == 0) return 1;
  return -1;
}

static int64_t env_positive(const char *name, int64_t fallback) {
  const char *v = getenv(name);
  if (!v || !*v) return fallback;
  char *end = NULL;
  long long n = strtoll(v, &end, 10);
  return (end && *end == '\0' && n > 0 && n <= ((int64_t)1 << 30)) ? (int64_t)n : fallback;
}

/* CQ_ATTN_KERNEL_* bits named in a comma-separated list (spaces around names allowed). */
static unsigned attn_kernels(const char *list) {
  static const struct {
    const char *name;
    unsigned bits;
  } names[] = {{"mma", CQ_ATTN_KERNEL_MMA},
               {"sm90", CQ_ATTN_KERNEL_SM90},
               {"int8", CQ_ATTN_KERNEL_INT8},
               {"all", CQ_ATTN_KERNEL_MMA | CQ_ATTN_KERNEL_SM90 | CQ_ATTN_KERNEL_INT8}};
  unsigned bits = 0;
  for (const char *p = list; p && *p;) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    while (len && *p == ' ') ++p, --len;
    while (len && p[len - 1] == ' ') --len;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; ++i)
      if (len == strlen(names[i].name) && strncmp(p, names[i].name, len) == 0) bits |= names[i].bits;
    p = end ? end + 1 : NULL;
  }
  return bits;
}

static void read_environment(cq_settings *s) {
  memset(s, 0, sizeof *s);
  s->disable_wgmma = env_flag("CQUANT_DISABLE_WGMMA");
  s->disable_cublaslt_fp8 = env_flag("CQUANT_DISABLE_CUBLASLT_FP8");
  s->wo_chunk_mib = env_positive("CQUANT_WO_CHUNK_MB", DEFAULT_WO_CHUNK_MIB);
  s->group4_decode_min_m = env_positive("CQUANT_GROUP4_DECODE_M", -1);
  s->wo_decode_min_m = env_positive("CQUANT_WO_DECODE_M", -1);
  const char *split = getenv("CQUANT_WO_SPLIT_K");
  s->wo_split_k = !(split && strcmp(split, "0") == 0);
  const char *pairs = getenv("CQUANT_WO_CLUSTER_PAIRS");
  s->wo_cluster_pairs = !(pairs && strcmp(pairs, "0") == 0);
  s->gemv_persistent = env_tristate("CQUANT_GEMV_PERSISTENT");
  s->attn_sm90 = env_tristate("CQUANT_ATTN_SM90");
  s->attn_disabled = attn_kernels(getenv("CQUANT_ATTN_DISABLE"));
  const char *share = getenv("CQUANT_SHARE_ACTIVATIONS");
  s->share_activations = !(share && strcmp(share, "0") == 0);
  const char *path = getenv("CQUANT_CUBLASLT_PATH");
  if (path) {
    strncpy(s->cublaslt_path, path, sizeof s->cublaslt_path - 1);
    s->cublaslt_path[sizeof s->cublaslt_path - 1] = '\0';
  }
}

cq_settings cq_settings_now(void) {
  pthread_mutex_lock(&settings_mutex);
  if (!loaded) {
    read_environment(&current);
    loaded = 1;
  }
  cq_settings s = current;
  pthread_mutex_unlock(&settings_mutex);
  return s;
}

cq_status cq_settings_get(cq_settings *out, size_t size) {
  if (!out) return cq_fail(CQ_ERR_INVALID_ARG, "out is required");
  if (size == 0 || size > sizeof(cq_settings))
    return cq_fail(CQ_ERR_INVALID_ARG, "size = %zu; expected sizeof(cq_settings) of the caller's cquant.h (at most %zu)",
                   size, sizeof(cq_settings));
  cq_settings s = cq_settings_now();
  memcpy(out, &s, size);
  return CQ_OK;
}

void cq_settings_reload(void) {
  cq_settings s;
  read_environment(&s);
  pthread_mutex_lock(&settings_mutex);
  current = s;
  loaded = 1;
  pthread_mutex_unlock(&settings_mutex);
}
