/* Compiled with -std=c89 -pedantic -Werror: the public header must stay C89. */
#include <stdio.h>
#include <string.h>

#include "dayzero.h"

int main(void) {
  dz_model_params mp;
  dz_model *model = NULL;
  dz_status st;
  dz_model_params_init(&mp);
  if (mp.struct_size != sizeof(mp)) return 1;
  if (dz_abi_version() != DZ_ABI_VERSION) return 2;
  if (strlen(dz_version()) < 5) return 3;
  st = dz_model_open("/nonexistent/dayzero-model", &mp, &model);
  if (st == DZ_OK || model != NULL) return 4;
  if (strstr(dz_last_error(), "/nonexistent/dayzero-model") == NULL) return 5;
  printf("c89 ok: dayzero %s, open failed as expected: %s: %s\n", dz_version(), dz_status_name(st), dz_last_error());
  return 0;
}
