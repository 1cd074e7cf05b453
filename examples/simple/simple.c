/*
 * simple.c - the smallest complete dayzero program (C89).
 *
 *   simple MODEL_DIR [N_TOKENS [PROMPT_ID ...]]
 *
 * Opens a model, greedily generates N_TOKENS (default 8) after the prompt ids
 * (default: the single id 0) and prints them on one line, "generated: ...",
 * followed by their text when the model has a tokenizer. Exits 1 with the
 * library's message on any error.
 *
 * Build against an installed dayzero:
 *   cc -std=c89 simple.c $(pkg-config --cflags --libs dayzero) -o simple
 */
#include <stdio.h>
#include <stdlib.h>

#include "dayzero.h"

#define MAX_PROMPT 256

static int fail(const char *what, dz_status st) {
  fprintf(stderr, "simple: %s failed: %s: %s\n", what, dz_status_name(st), dz_last_error());
  return 1;
}

int main(int argc, char **argv) {
  dz_model *model = NULL;
  dz_kv_arena *arena = NULL;
  dz_session *session = NULL;
  const dz_tokenizer *tok = NULL;
  dz_detokenizer *detok = NULL;
  dz_model_params mp;
  dz_model_info info;
  dz_kv_arena_params ap;
  int32_t prompt[MAX_PROMPT];
  size_t n_prompt = 0;
  long i, n_tokens = 8;
  int32_t *ids = NULL;
  dz_status st;
  int rc = 1;

  if (argc < 2) {
    fprintf(stderr, "usage: %s MODEL_DIR [N_TOKENS [PROMPT_ID ...]]\n", argv[0]);
    return 2;
  }
  if (argc > 2) n_tokens = strtol(argv[2], NULL, 10);
  for (i = 3; i < argc && n_prompt < MAX_PROMPT; ++i) prompt[n_prompt++] = (int32_t)strtol(argv[i], NULL, 10);
  if (n_prompt == 0) prompt[n_prompt++] = 0;
  if (dz_abi_version() != DZ_ABI_VERSION) {
    fprintf(stderr, "simple: library ABI %d, header ABI %d\n", dz_abi_version(), DZ_ABI_VERSION);
    return 1;
  }

  dz_model_params_init(&mp); /* defaults: CPU backend, all cores */
  st = dz_model_open(argv[1], &mp, &model);
  if (st != DZ_OK) return fail("dz_model_open", st);
  dz_model_info_init(&info);
  st = dz_model_get_info(model, &info);
  if (st != DZ_OK) {
    fail("dz_model_get_info", st);
    goto done;
  }
  printf("dayzero %s: %s, %d layers, vocab %d\n", dz_version(), info.architecture, (int)info.n_layers,
         (int)info.n_vocab);

  dz_kv_arena_params_init(&ap);
  ap.capacity_bytes = (uint64_t)16 << 20; /* a small paged KV pool: enough for a short run */
  st = dz_kv_arena_create(model, &ap, &arena);
  if (st != DZ_OK) {
    fail("dz_kv_arena_create", st);
    goto done;
  }
  st = dz_session_create(arena, NULL, &session); /* default sampler: greedy */
  if (st != DZ_OK) {
    fail("dz_session_create", st);
    goto done;
  }
  st = dz_session_append(session, prompt, n_prompt, DZ_LOGITS_LAST);
  if (st != DZ_OK) {
    fail("dz_session_append", st);
    goto done;
  }
  if (dz_model_tokenizer(model, &tok) != DZ_OK || dz_detokenizer_create(tok, &detok) != DZ_OK) detok = NULL;

  ids = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n_tokens > 0 ? n_tokens : 1));
  if (ids == NULL) goto done;
  printf("generated:");
  for (i = 0; i < n_tokens; ++i) {
    st = dz_generate_step(&session, 1, &ids[i]); /* sample, append, compute logits */
    if (st != DZ_OK) {
      printf("\n");
      fail("dz_generate_step", st);
      goto done;
    }
    printf(" %ld", (long)ids[i]);
  }
  printf("\n");
  if (detok != NULL) { /* the streaming detokenizer never splits a UTF-8 character */
    printf("text: ");
    for (i = 0; i < n_tokens; ++i) {
      const char *piece;
      size_t len;
      if (dz_detokenizer_push(detok, ids[i], &piece, &len) == DZ_OK) fwrite(piece, 1, len, stdout);
    }
    printf("\n");
  }
  rc = 0;

done:
  free(ids);
  dz_detokenizer_free(detok);
  dz_session_free(session);
  dz_kv_arena_free(arena);
  dz_model_free(model);
  return rc;
}
