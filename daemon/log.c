/* log.c - log lines on stderr, with journald's priority prefixes when stderr is the journal.
 *
 * Floor 1 (daemon.h's floors).
 */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static enum sl_log_level max_level = SL_LOG_INFO;

void sl_log_set_level(enum sl_log_level level) {
  max_level = level;
}

int sl_log_parse_level(const char *name) {
  static const struct {
    const char *name;
    enum sl_log_level level;
  } names[] = {{"error", SL_LOG_ERROR}, {"warn", SL_LOG_WARN}, {"info", SL_LOG_INFO},
               {"debug", SL_LOG_DEBUG}};

  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    if (strcmp(name, names[i].name) == 0)
      return (int)names[i].level;
  return -1;
}

static const char *level_name(enum sl_log_level level) {
  switch (level) {
    case SL_LOG_ERROR:
      return "error";
    case SL_LOG_WARN:
      return "warning";
    case SL_LOG_INFO:
      return "info";
    default:
      return "debug";
  }
}

/* stderr is the journal when $JOURNAL_STREAM ("device:inode", set by systemd) names the file
 * stderr is: a daemon started by a service whose stderr was redirected to a file inherits the
 * variable but must not write <N> prefixes there. */
static int stderr_is_journal(void) {
  const char *env = getenv("JOURNAL_STREAM");
  unsigned long long dev, ino;
  struct stat st;

  if (env == NULL || sscanf(env, "%llu:%llu", &dev, &ino) != 2 || fstat(STDERR_FILENO, &st) != 0)
    return 0;
  return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

void sl_log(enum sl_log_level level, const char *fmt, ...) {
  static int journald = -1;
  char line[1024];
  va_list ap;

  if (level > max_level)
    return;
  if (journald < 0)
    journald = stderr_is_journal();
  va_start(ap, fmt);
  vsnprintf(line, sizeof(line), fmt, ap);
  va_end(ap);
  /* One fprintf per line: lines from one process never interleave mid-line. */
  if (journald)
    fprintf(stderr, "<%d>%s\n", (int)level, line);
  else
    fprintf(stderr, "subletd: %s: %s\n", level_name(level), line);
}
