/* bcachefilter tools: messages on stderr, "PROGRAM: ..." (shared by the
 * command-line tools, each of which defines its PROGRAM_NAME). */
#ifndef BCACHEFILTER_TOOL_MSG_H
#define BCACHEFILTER_TOOL_MSG_H

#include <stdarg.h>

/* "PROGRAM: DEVICE: message\n"; errno is kept for %m in fmt. */
void tool_device_error (const char *program, const char *path,
                        const char *fmt, va_list args);

#define DEFINE_DEVICE_ERROR                                             \
  static void __attribute__ ((format (printf, 2, 3)))                   \
  device_error (const char *path, const char *fs, ...)                  \
  {                                                                     \
    va_list args;                                                       \
    va_start (args, fs);                                                \
    tool_device_error (PROGRAM_NAME, path, fs, args);                   \
    va_end (args);                                                      \
  }

#endif /* BCACHEFILTER_TOOL_MSG_H */
