/* jobs.c - work off the event loop: saves, restores (and moves) of kept bytes, and drafts of
 * loans with long keep lists (sorting millions of ranges).
 *
 * A copy of gigabytes takes a large fraction of a second; on the loop it would hold every
 * other client that long. A job's transfer runs on libuv's thread pool, and its done callback
 * on the loop afterwards. Jobs run one at a time, in the order they were submitted: a restore
 * never overtakes the save it undoes, and the device's copy stream has one user at a time.
 * Small copies with nothing queued run on the loop instead (sl_jobs_inline): the trip through
 * the thread pool would cost more than they do (a page of 64 KiB blocks: 2 MiB in 40 us).
 */
#include <stdlib.h>

#include "clock.h"
#include "daemon.h"
#include "log.h"

static void start_next(struct sl_daemon *d);

static void run_job(uv_work_t *w) {
  struct sl_job *j = w->data;
  j->ran_at = sl_clock_now();
  if (j->rc == 0 && j->transfer != NULL) /* rc set already: the submitter could not prepare */
    j->rc = sl_pool_transfer_run(j->transfer, &j->seconds, &j->move_seconds, &j->err);
  else if (j->rc == 0 && j->run != NULL)
    j->run(j);
}

static void after_job(uv_work_t *w, int status) {
  struct sl_job *j = w->data;
  struct sl_daemon *d = j->d;

  double ended_at = sl_clock_now(), queued = j->ran_at - j->submitted_at;
  double ran = ended_at - j->ran_at, copies = j->seconds, moves = j->move_seconds;

  if (status != 0 && j->rc == 0) /* cancelled: never happens, the loop only stops when idle */
    j->rc = sl_err_set(&j->err, SUBLET_ECANCELED, "a copy was cancelled");
  d->jobs = j->next;
  if (d->jobs == NULL)
    d->jobs_tail = NULL;
  sl_pool_transfer_free(j->transfer);
  j->transfer = NULL;
  if (j->conn != NULL)
    j->conn->job = NULL;
  j->done(j); /* may free j, submit jobs, resume or close connections */
  sl_debug("job: %.3f ms queued, %.3f ms run (copies %.3f ms, moves %.3f ms), %.3f ms done "
           "on the loop", 1e3 * queued, 1e3 * ran, 1e3 * copies, 1e3 * moves,
           1e3 * (sl_clock_now() - ended_at));
  start_next(d);
}

static void start_next(struct sl_daemon *d) {
  struct sl_job *j = d->jobs;

  if (j == NULL || j->started) {
    if (j == NULL && d->stopping)
      uv_stop(d->loop); /* the last copy is done: the daemon may go */
    return;
  }
  j->started = 1;
  j->work.data = j;
  uv_queue_work(d->loop, &j->work, run_job, after_job);
}

void sl_job_submit(struct sl_daemon *d, struct sl_job *j) {
  j->d = d;
  j->submitted_at = sl_clock_now();
  j->next = NULL;
  j->started = 0;
  if (j->conn != NULL)
    j->conn->job = j;
  if (d->jobs_tail != NULL)
    d->jobs_tail->next = j;
  else
    d->jobs = j;
  d->jobs_tail = j;
  start_next(d);
}

int sl_jobs_idle(const struct sl_daemon *d) {
  return d->jobs == NULL;
}

int sl_jobs_inline(const struct sl_daemon *d, uint64_t bytes) {
  return d->jobs == NULL && bytes <= SL_JOB_INLINE_BYTES;
}
