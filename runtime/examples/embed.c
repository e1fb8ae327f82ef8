/*===- embed.c - Embedding the Loom runtime from C -----------------------===*
 *
 * usage: loom-embed-example BUNDLE
 *
 * Opens a bundle, fills every input (token ids 0, 1, 2, ... below the
 * input's size; floats 0.5), runs the forward pass and prints the first
 * values of each output. Every call's status is checked.
 *
 *===---------------------------------------------------------------------===*/

#include "loom/runtime.h"

#include <stdio.h>
#include <stdlib.h>

static int check(loom_status_t *status, const char *what) {
  if (!status)
    return 0;
  fprintf(stderr, "%s failed: %s\n", what, loom_status_message(status));
  loom_status_free(status);
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s BUNDLE\n", argv[0]);
    return 1;
  }
  loom_session_options_t options;
  loom_session_options_init(&options);
  options.num_threads = 1;

  loom_session_t *session = NULL;
  if (check(loom_session_create(argv[1], &options, &session), "loom_session_create"))
    return 1;

  int rc = 0;
  for (int32_t i = 0; i < loom_session_num_inputs(session) && !rc; ++i) {
    loom_tensor_info_t info;
    rc = check(loom_session_input_info(session, i, &info), "loom_session_input_info");
    if (rc)
      break;
    unsigned char *data = malloc(info.bytes ? info.bytes : 1);
    size_t n = info.bytes / (info.dtype == LOOM_I64 || info.dtype == LOOM_F64 ? 8 : 4);
    for (size_t k = 0; k < n; ++k) {
      if (info.dtype == LOOM_I32)
        ((int32_t *)data)[k] = (int32_t)(k % 7);
      else if (info.dtype == LOOM_F32)
        ((float *)data)[k] = 0.5f;
    }
    rc = check(loom_session_bind_input(session, info.name, data, info.bytes), "loom_session_bind_input");
    free(data);
  }
  if (!rc)
    rc = check(loom_session_run_forward(session), "loom_session_run_forward");
  if (loom_session_num_ranks(session) > 1 && loom_session_rank(session) != 0) {
    loom_session_destroy(session); /* rank 0 reports for the job */
    return rc;
  }
  for (int32_t i = 0; i < loom_session_num_outputs(session) && !rc; ++i) {
    loom_tensor_info_t info;
    rc = check(loom_session_output_info(session, i, &info), "loom_session_output_info");
    if (rc || info.dtype != LOOM_F32)
      continue;
    float *out = malloc(info.bytes);
    rc = check(loom_session_read_output(session, info.name, out, info.bytes), "loom_session_read_output");
    if (!rc) {
      printf("%s:", info.name);
      for (size_t k = 0; k < 4 && k < info.bytes / 4; ++k)
        printf(" %g", out[k]);
      printf("\n");
    }
    free(out);
  }
  /* A wrong name is an error with a message, not a crash. */
  loom_status_t *bad = loom_session_bind_input(session, "no-such-input", "", 0);
  printf("binding a missing input: %s\n", loom_status_message(bad));
  loom_status_free(bad);

  loom_session_destroy(session);
  return rc;
}
