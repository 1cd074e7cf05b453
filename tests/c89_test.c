/* Compiled with -std=c89 -pedantic -Werror: the public header must stay C89. */
#include <stdio.h>
#include <string.h>

#include "dayzero.h"

/* A program built against an older header: its dz_sampler_params ended after
 * top_p. The sized init must fill that much and write nothing past it. */
typedef struct old_sampler_params {
  size_t struct_size;
  float temperature;
  int32_t top_k;
  float top_p;
} old_sampler_params;

int main(void) {
  dz_model_params mp;
  dz_model_info info;
  dz_kv_arena_params ap;
  dz_kv_stats ks;
  dz_sampler_params sp;
  dz_session_params ssp;
  dz_session_stats ss;
  union {
    old_sampler_params old;
    unsigned char bytes[sizeof(dz_sampler_params) + 16];
  } buf;
  void (*unsized)(dz_model_params *) = dz_model_params_init; /* the exported function */
  dz_model *model = NULL;
  dz_status st;
  size_t i;

  /* The *_init macros pass sizeof *(p) to the *_init_sized functions. */
  dz_model_params_init(&mp);
  if (mp.struct_size != sizeof(mp) || mp.bf16_sensitive != 1) return 1;
  dz_model_info_init(&info);
  if (info.struct_size != sizeof(info)) return 1;
  dz_kv_arena_params_init(&ap);
  if (ap.struct_size != sizeof(ap) || ap.prefix_cache != 1) return 1;
  dz_kv_stats_init(&ks);
  if (ks.struct_size != sizeof(ks)) return 1;
  dz_sampler_params_init(&sp);
  if (sp.struct_size != sizeof(sp) || sp.top_p != 1.0f) return 1;
  dz_session_params_init(&ssp);
  if (ssp.struct_size != sizeof(ssp) || ssp.sampler.struct_size != sizeof(sp) || ssp.sampler.top_p != 1.0f) return 1;
  dz_session_stats_init(&ss);
  if (ss.struct_size != sizeof(ss)) return 1;

  /* The functions of the macros' names stay callable, in parentheses or
   * through a pointer. */
  memset(&mp, 0, sizeof mp);
  (dz_model_params_init)(&mp);
  if (mp.struct_size != sizeof(mp) || mp.bf16_sensitive != 1) return 6;
  memset(&mp, 0, sizeof mp);
  unsized(&mp);
  if (mp.struct_size != sizeof(mp) || mp.bf16_sensitive != 1) return 6;

  /* An older, shorter struct, as its program's macro passes it: the bytes
   * past it stay as they were. */
  memset(&buf, 0xAB, sizeof buf);
  dz_sampler_params_init_sized((dz_sampler_params *)&buf.old, sizeof buf.old);
  if (buf.old.struct_size != sizeof(old_sampler_params) || buf.old.top_p != 1.0f || buf.old.temperature != 0.0f ||
      buf.old.top_k != 0)
    return 7;
  for (i = sizeof(old_sampler_params); i < sizeof buf.bytes; ++i)
    if (buf.bytes[i] != 0xAB) return 8;

  if (dz_abi_version() != DZ_ABI_VERSION) return 2;
  if (strlen(dz_version()) < 5) return 3;
  st = dz_model_open("/nonexistent/dayzero-model", &mp, &model);
  if (st == DZ_OK || model != NULL) return 4;
  if (strstr(dz_last_error(), "/nonexistent/dayzero-model") == NULL) return 5;
  printf("c89 ok: dayzero %s, *_init macros sized, open failed as expected: %s: %s\n", dz_version(),
         dz_status_name(st), dz_last_error());
  return 0;
}
