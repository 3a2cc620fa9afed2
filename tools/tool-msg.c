/* bcachefilter tools: messages on stderr (tool-msg.h). */
#include "config.h"

#include <errno.h>
#include <stdio.h>

#include "tool-msg.h"

void
tool_device_error (const char *program, const char *path, const char *fmt,
                   va_list args)
{
  const int saved_errno = errno;   /* for %m in fmt */

  fprintf (stderr, "%s: %s: ", program, path);
  errno = saved_errno;
  vfprintf (stderr, fmt, args);
  fputc ('\n', stderr);
}
