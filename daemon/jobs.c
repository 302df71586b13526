/* jobs.c - work off the event loop: saves, restores (and moves) of kept bytes, and drafts of
 * loans with long keep lists (sorting millions of ranges).
 *
 * A copy of gigabytes takes a large fraction of a second; on the loop it would hold every
 * other client that long. A job's transfer runs on libuv's thread pool, and its done callback
 * on the loop afterwards. Jobs run one at a time, in the order they were submitted: a restore
 * never overtakes the save it undoes, and the device's copy stream has one user at a time.
 * Small copies with nothing queued run on the loop instead (sl_jobs_inline): the trip through
 * the thread pool would cost more than they do (a page of 64 KiB blocks: 2 MiB in 40 us).
 *
 * Host work (sl_jobs_submit_host: decoding a large request, drafting a long keep list) has no
 * place in that order and touches only its job, so it runs in a second lane beside the
 * copies, from one queue per uid: the users with work waiting take turns, one job each, so
 * that a user who sends a hundred huge keep lists delays another user's call by one job, not
 * by a hundred (one queue for all made others wait 27 to 29 s).
 *
 * The pin ahead of the save area (pins.c) is a third lane of its own; idleness counts it.
 *
 * Floor 3 (daemon.h's floors).
 */
#include <stdlib.h>

#include "clock.h"
#include "daemon.h"
#include "log.h"

/* A uid's host jobs waiting, and the bytes its jobs hold. Freed once it has neither. */
struct sl_job_user {
  struct sl_job_user *next;
  uid_t uid;
  struct sl_job *head, *tail;
  size_t held;
};

static void start_next(struct sl_daemon *d);
static void start_next_host(struct sl_daemon *d);

static void run_job(uv_work_t *w) {
  struct sl_job *j = w->data;
  j->ran_at = sl_clock_now();
  if (j->rc == 0 && j->transfer != NULL) /* rc set already: the submitter could not prepare */
    j->rc = sl_pool_transfer_run(j->transfer, &j->seconds, &j->move_seconds, &j->err);
  else if (j->rc == 0 && j->run != NULL)
    j->run(j);
}

/* The loop may stop once shutdown has begun and no job of either lane is left. */
void sl_jobs_maybe_stop(struct sl_daemon *d) {
  if (d->stopping && sl_jobs_idle(d))
    uv_stop(d->loop);
}

/* What every job's end shares: its connection may read again, done owns the job. */
static void finish(struct sl_daemon *d, struct sl_job *j, int status) {
  double ended_at = sl_clock_now(), queued = j->ran_at - j->submitted_at;
  double ran = ended_at - j->ran_at, copies = j->seconds, moves = j->move_seconds;

  if (status != 0 && j->rc == 0) /* cancelled: never happens, the loop only stops when idle */
    j->rc = sl_err_set(&j->err, SUBLET_ECANCELED, "a copy was cancelled");
  sl_pool_transfer_free(j->transfer);
  j->transfer = NULL;
  if (j->conn != NULL)
    j->conn->job = NULL;
  j->done(j); /* may free j, submit jobs, resume or close connections */
  sl_debug("job: %.3f ms queued, %.3f ms run (copies %.3f ms, moves %.3f ms), %.3f ms done "
           "on the loop", 1e3 * queued, 1e3 * ran, 1e3 * copies, 1e3 * moves,
           1e3 * (sl_clock_now() - ended_at));
}

static void after_job(uv_work_t *w, int status) {
  struct sl_job *j = w->data;
  struct sl_daemon *d = j->d;

  d->jobs = j->next;
  if (d->jobs == NULL)
    d->jobs_tail = NULL;
  finish(d, j, status);
  /* Only now: the next job sees what this one's done changed (a growth's moved mapping is
   * taken over there, and a transfer must never run before it: pool_impl.h). */
  start_next(d);
  sl_jobs_maybe_stop(d);
}

static void start_next(struct sl_daemon *d) {
  struct sl_job *j = d->jobs;

  if (j == NULL || j->started)
    return;
  j->started = 1;
  j->work.data = j;
  uv_queue_work(d->loop, &j->work, run_job, after_job);
}

static void prepare(struct sl_daemon *d, struct sl_job *j) {
  j->d = d;
  j->submitted_at = sl_clock_now();
  j->next = NULL;
  j->started = 0;
  if (j->conn != NULL)
    j->conn->job = j;
}

void sl_jobs_submit(struct sl_daemon *d, struct sl_job *j) {
  prepare(d, j);
  j->host = 0; /* a job resubmitted after its host part keeps its place among the copies */
  if (d->jobs_tail != NULL)
    d->jobs_tail->next = j;
  else
    d->jobs = j;
  d->jobs_tail = j;
  start_next(d);
}

/* ------------------------------------------------------------------ host work, by user */

static struct sl_job_user *job_user(struct sl_daemon *d, uid_t uid, int make) {
  struct sl_job_user **link = &d->job_users;

  for (; *link != NULL; link = &(*link)->next)
    if ((*link)->uid == uid)
      return *link;
  if (make && (*link = calloc(1, sizeof(**link))) != NULL)
    (*link)->uid = uid;
  return *link;
}

/* Unlinks u from the turn order; frees it when it has nothing left. */
static void user_unlink(struct sl_daemon *d, struct sl_job_user *u) {
  struct sl_job_user **link = &d->job_users;

  while (*link != u)
    link = &(*link)->next;
  *link = u->next;
  u->next = NULL;
}

/* u has had its turn: to the back of the line while it has more, else out of it. */
static void user_turn_over(struct sl_daemon *d, struct sl_job_user *u) {
  struct sl_job_user **link;

  user_unlink(d, u);
  if (u->head == NULL && u->held == 0) {
    free(u);
    return;
  }
  for (link = &d->job_users; *link != NULL; link = &(*link)->next)
    ;
  *link = u;
}

static void after_host(uv_work_t *w, int status) {
  struct sl_job *j = w->data;
  struct sl_daemon *d = j->d;
  struct sl_job_user *u = job_user(d, j->uid, 0);

  d->host_running = NULL;
  if (u != NULL) {
    u->held -= j->held;
    user_turn_over(d, u);
  }
  finish(d, j, status);
  start_next_host(d);
  sl_jobs_maybe_stop(d);
}

/* The first user in line with a job waiting runs it; its turn ends when the job does. */
static void start_next_host(struct sl_daemon *d) {
  struct sl_job_user *u = d->job_users;
  struct sl_job *j;

  while (u != NULL && u->head == NULL)
    u = u->next;
  if (u == NULL || d->host_running != NULL)
    return;
  j = u->head;
  u->head = j->next;
  if (u->head == NULL)
    u->tail = NULL;
  j->started = 1;
  j->work.data = j;
  d->host_running = j;
  uv_queue_work(d->loop, &j->work, run_job, after_host);
}

int sl_jobs_submit_host(struct sl_daemon *d, struct sl_job *j, uid_t uid, size_t held,
                        struct sl_err *err) {
  struct sl_job_user *u = job_user(d, uid, 1);
  char a[32], b[32];

  if (u == NULL) { /* no memory for a queue: the job takes its place among the copies */
    sl_jobs_submit(d, j);
    return 0;
  }
  if (held > SL_JOBS_HELD_PER_USER - u->held) {
    if (u->head == NULL && u->held == 0)
      user_turn_over(d, u); /* made for nothing: freed */
    return sl_err_set(err, SUBLET_EBUSY, "uid %u's large requests in progress hold %s of "
                      "subletd's memory and this one needs %s more, past the limit per user: "
                      "wait for their replies before sending more", (unsigned)uid,
                      sl_format_size(a, u->held), sl_format_size(b, held));
  }
  prepare(d, j);
  j->host = 1;
  j->uid = uid;
  j->held = held;
  u->held += held;
  if (u->tail != NULL)
    u->tail->next = j;
  else
    u->head = j;
  u->tail = j;
  start_next_host(d);
  return 0;
}

size_t sl_jobs_held(const struct sl_daemon *d, uid_t uid) {
  for (const struct sl_job_user *u = d->job_users; u != NULL; u = u->next)
    if (u->uid == uid)
      return u->held;
  return 0;
}

int sl_jobs_idle(const struct sl_daemon *d) {
  const struct sl_job_user *u = d->job_users;

  while (u != NULL && u->head == NULL)
    u = u->next;
  return d->jobs == NULL && d->host_running == NULL && u == NULL && d->pinner == NULL;
}

int sl_jobs_inline(const struct sl_daemon *d, uint64_t bytes) {
  return d->jobs == NULL && bytes <= SL_JOB_INLINE_BYTES; /* host work is no copy to overtake */
}
