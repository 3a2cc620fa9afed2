/* bcachefilter engine: the names of the run-time settings
 * (bcachefilter/request.h, bcf_setting_find).
 *
 * Design: one table, in the order messages list the names; the message
 * text is built from it once.  Locking: none (constant data, and a
 * pthread_once for the text).
 */
#include "config.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "bcachefilter/request.h"

static const struct bcf_setting settings[] = {
  { "cache_mode", BCF_SETTING_WORD },
  { "sequential_cutoff", BCF_SETTING_SIZE },
  { "sequential_bypass", BCF_SETTING_WORD },
  { "congested_read_threshold_us", BCF_SETTING_NUMBER },
  { "congested_write_threshold_us", BCF_SETTING_NUMBER },
  { "writeback_percent", BCF_SETTING_NUMBER },
  { "writeback_delay", BCF_SETTING_NUMBER },
  { "writeback_running", BCF_SETTING_NUMBER },
  { "writeback_rate_update_seconds", BCF_SETTING_NUMBER },
  { "copy_gc_enabled", BCF_SETTING_NUMBER },
};
#define NSETTINGS (sizeof settings / sizeof settings[0])

const struct bcf_setting *
bcf_setting_find (const char *name)
{
  for (size_t i = 0; i < NSETTINGS; i++)
    if (strcmp (settings[i].name, name) == 0)
      return &settings[i];
  return NULL;
}

static char names[512];
static pthread_once_t names_once = PTHREAD_ONCE_INIT;

static void
make_names (void)
{
  size_t used = 0;

  for (size_t i = 0; i < NSETTINGS && used < sizeof names; i++)
    used += (size_t) snprintf (names + used, sizeof names - used, "%s%s",
                               i == 0 ? "" : i + 1 == NSETTINGS ? " and "
                               : ", ", settings[i].name);
}

const char *
bcf_setting_names (void)
{
  pthread_once (&names_once, make_names);
  return names;
}
