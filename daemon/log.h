/* log.h - subletd's log: one line per event on stderr, which journald reads.
 *
 * When stderr is the journal ($JOURNAL_STREAM names stderr's device and inode) each line starts
 * with a <N> syslog priority prefix so that journald files it at the right level; anywhere else
 * (a terminal, a file) lines read "subletd: level: text".
 */
#ifndef SL_LOG_H
#define SL_LOG_H

enum sl_log_level { SL_LOG_ERROR = 3, SL_LOG_WARN = 4, SL_LOG_INFO = 6, SL_LOG_DEBUG = 7 };

void sl_log_set_level(enum sl_log_level level);
/* Parses "error", "warn", "info" or "debug"; returns -1 for anything else. */
int sl_log_parse_level(const char *name);
void sl_log(enum sl_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define sl_error(...) sl_log(SL_LOG_ERROR, __VA_ARGS__)
#define sl_warn(...) sl_log(SL_LOG_WARN, __VA_ARGS__)
#define sl_info(...) sl_log(SL_LOG_INFO, __VA_ARGS__)
#define sl_debug(...) sl_log(SL_LOG_DEBUG, __VA_ARGS__)

#endif
