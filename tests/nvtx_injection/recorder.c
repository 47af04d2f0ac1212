/* An NVTX injection library for tests: records every pushed range and pop to a file per process
 * ($PIPECORE_NVTX_LOG.<pid>), so NVTX ranges can be checked on a machine without a GPU or Nsight.
 * Loaded by NVTX itself through NVTX_INJECTION64_PATH. */
#include <nvtx3/nvToolsExt.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static FILE* out = NULL;

static int pop(void);

static int push_a(const char* message) {
  if (out) {
    fprintf(out, "push %s\n", message ? message : "");
    fflush(out);
  }
  return 0;
}

static int push_ex(const nvtxEventAttributes_t* attr) {
  const char* text = "?";
  if (attr && attr->messageType == NVTX_MESSAGE_TYPE_ASCII) text = attr->message.ascii;
  /* registered strings: the handle is the strdup'ed text (see register_string) */
  if (attr && attr->messageType == NVTX_MESSAGE_TYPE_REGISTERED) text = (const char*)attr->message.registered;
  return push_a(text);
}

static int domain_push_ex(nvtxDomainHandle_t domain, const nvtxEventAttributes_t* attr) {
  (void)domain;
  return push_ex(attr);
}

static int domain_pop(nvtxDomainHandle_t domain) {
  (void)domain;
  return pop();
}

static nvtxStringHandle_t register_string(nvtxDomainHandle_t domain, const char* text) {
  (void)domain;
  return (nvtxStringHandle_t)strdup(text ? text : "");
}

static nvtxDomainHandle_t create_domain(const char* name) {
  return (nvtxDomainHandle_t)strdup(name ? name : "");
}

static int pop(void) {
  if (out) {
    fprintf(out, "pop\n");
    fflush(out);
  }
  return 0;
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
  const NvtxExportTableCallbacks* callbacks = (const NvtxExportTableCallbacks*)get_table(NVTX_ETID_CALLBACKS);
  NvtxFunctionTable table = NULL;
  unsigned int size = 0;
  if (!callbacks || !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size)) return 0;
  if (size <= NVTX_CBID_CORE_RangePop) return 0;
  *table[NVTX_CBID_CORE_RangePushA] = (NvtxFunctionPointer)push_a;
  *table[NVTX_CBID_CORE_RangePushEx] = (NvtxFunctionPointer)push_ex;
  *table[NVTX_CBID_CORE_RangePop] = (NvtxFunctionPointer)pop;
  NvtxFunctionTable table2 = NULL;
  unsigned int size2 = 0;
  if (callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table2, &size2) &&
      size2 > NVTX_CBID_CORE2_DomainRegisterStringA) {
    *table2[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)domain_push_ex;
    *table2[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)domain_pop;
    *table2[NVTX_CBID_CORE2_DomainRegisterStringA] = (NvtxFunctionPointer)register_string;
    *table2[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)create_domain;
  }
  const char* base = getenv("PIPECORE_NVTX_LOG");
  if (base) {
    char path[4096];
    snprintf(path, sizeof(path), "%s.%d", base, (int)getpid());
    out = fopen(path, "a");
  }
  return 1;
}
