/*
 * llm_datadist status codes: the single source of truth.
 *
 * Values follow CANN LLM-DataDist (base 0x5010B000). tools/status_table.py generates the mirrors
 * llm_datadist/_status_codes.py (read by status.py and cpp.py) and _status.pxd from the
 * `#define DD_LLM_<name> <value>u` lines below; setup.py refuses to build while a mirror differs
 * from this file (`make status` regenerates them) and tests/api/test_status_table.py checks them.
 */
#ifndef LLM_DATADIST_DD_STATUS_H
#define LLM_DATADIST_DD_STATUS_H

#include <stdint.h>

typedef uint32_t dd_status;

#define DD_LLM_SUCCESS                      0x00000000u
#define DD_LLM_FAILED                       0xFFFFFFFFu
#define DD_LLM_WAIT_PROC_TIMEOUT            0x5010B001u
#define DD_LLM_KV_CACHE_NOT_EXIST           0x5010B002u
#define DD_LLM_REPEAT_REQUEST               0x5010B003u
#define DD_LLM_REQUEST_ALREADY_COMPLETED    0x5010B004u
#define DD_LLM_PARAM_INVALID                0x5010B005u
#define DD_LLM_ENGINE_FINALIZED             0x5010B006u
#define DD_LLM_NOT_YET_LINK                 0x5010B007u
#define DD_LLM_ALREADY_LINK                 0x5010B008u
#define DD_LLM_LINK_FAILED                  0x5010B009u
#define DD_LLM_UNLINK_FAILED                0x5010B00Au
#define DD_LLM_NOTIFY_PROMPT_UNLINK_FAILED  0x5010B00Bu
#define DD_LLM_CLUSTER_NUM_EXCEED_LIMIT     0x5010B00Cu
#define DD_LLM_PROCESSING_LINK              0x5010B00Du
#define DD_LLM_DEVICE_OUT_OF_MEMORY         0x5010B00Eu
#define DD_LLM_PREFIX_ALREADY_EXIST         0x5010B00Fu
#define DD_LLM_PREFIX_NOT_EXIST             0x5010B010u
#define DD_LLM_SEQ_LEN_OVER_LIMIT           0x5010B011u
#define DD_LLM_NO_FREE_BLOCK                0x5010B012u
#define DD_LLM_BLOCKS_OUT_OF_MEMORY         0x5010B013u
#define DD_LLM_CACHE_INCOMPATIBLE           0x5010B014u
#define DD_LLM_CACHE_KEY_ALREADY_EXIST      0x5010B015u
#define DD_LLM_COPY_CACHE_FAILED            0x5010B016u
#define DD_LLM_CACHE_ID_ALREADY_EXIST       0x5010B017u
#define DD_LLM_EXIST_LINK                   0x5010B018u
#define DD_LLM_FEATURE_NOT_ENABLED          0x5010B019u
#define DD_LLM_TIMEOUT                      0x5010B01Au
#define DD_LLM_LINK_BUSY                    0x5010B01Bu
#define DD_LLM_OUT_OF_MEMORY                0x5010B01Cu
/* ACL runtime codes that CANN surfaces unchanged. */
#define DD_LLM_DEVICE_MEM_ERROR             507053u
#define DD_LLM_SUSPECT_REMOTE_ERROR         507057u

#endif /* LLM_DATADIST_DD_STATUS_H */
