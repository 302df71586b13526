/* tms_daemon.c - the preload library's connection to the subletd of each CUDA device, made at
 * the device's first region allocation and kept for the process's life.
 *
 * Which daemon: $SUBLET_SOCKET as it is, else the one serving this GPU (its UUID, as the
 * driver reports it under CUDA_VISIBLE_DEVICES) among the system daemons (/run/sublet,
 * gpuN.sock first) and then this user's (where sublet's Python package starts them:
 * $XDG_RUNTIME_DIR/sublet or /tmp/sublet-UID); with none, this user's is started
 * (tms_start.c), as sublet's Python package would.
 */
#include "tms.h"

#include <dirent.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TMS_SYSTEM_DIR "/run/sublet"

static pthread_mutex_t daemon_lock = PTHREAD_MUTEX_INITIALIZER;
static sublet_client *clients[TMS_MAX_DEVICES];
static int on_host[TMS_MAX_DEVICES]; /* the daemon's memfd backend: device memory is host memory */

/* The connection at path if its daemon serves uuid (NULL: any), else NULL. */
static sublet_client *open_serving(const char *path, const uint8_t *uuid) {
  sublet_client *c = NULL;
  struct sublet_info info;

  if (sublet_connect(path, &c) != 0)
    return NULL;
  if (uuid == NULL || (sublet_get_info(c, &info) == 0 &&
                       memcmp(info.device_uuid, uuid, sizeof info.device_uuid) == 0))
    return c;
  sublet_disconnect(c);
  return NULL;
}

/* The first socket of dir serving uuid; first_name is tried before the others. */
static sublet_client *search_dir(const char *dir, const char *first_name, const uint8_t *uuid) {
  char path[PATH_MAX];
  sublet_client *c = NULL;
  struct dirent *e;
  DIR *d;

  if (first_name != NULL && snprintf(path, sizeof path, "%s/%s", dir, first_name) > 0 &&
      access(path, F_OK) == 0 && (c = open_serving(path, uuid)) != NULL)
    return c;
  if (uuid == NULL || (d = opendir(dir)) == NULL)
    return NULL;
  while (c == NULL && (e = readdir(d)) != NULL) {
    size_t n = strlen(e->d_name);
    if (n < 6 || strcmp(e->d_name + n - 5, ".sock") != 0 ||
        (first_name != NULL && strcmp(e->d_name, first_name) == 0))
      continue;
    if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) < (int)sizeof path)
      c = open_serving(path, uuid);
  }
  closedir(d);
  return c;
}

static void user_dir(char *out, size_t n) {
  const char *runtime = getenv("XDG_RUNTIME_DIR");

  if (runtime != NULL && runtime[0] != '\0')
    snprintf(out, n, "%s/sublet", runtime);
  else
    snprintf(out, n, "/tmp/sublet-%u", (unsigned)getuid());
}


/* GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi writes it: the user daemon's name. */
static const char *uuid_name(const uint8_t uuid[16], char *out, size_t n) {
  size_t at = (size_t)snprintf(out, n, "GPU-");

  for (int i = 0; i < 16 && at + 4 < n; i++) {
    if (i == 4 || i == 6 || i == 8 || i == 10)
      out[at++] = '-';
    at += (size_t)snprintf(out + at, n - at, "%02x", uuid[i]);
  }
  return out;
}

static sublet_client *find(int device) {
  const char *explicit_path = getenv("SUBLET_SOCKET");
  uint8_t uuid[16];
  char name[48], dir[PATH_MAX];
  int known = tms_cuda_uuid(device, uuid) == 0;
  sublet_client *c;

  if (explicit_path != NULL && explicit_path[0] != '\0')
    return open_serving(explicit_path, NULL);
  snprintf(name, sizeof name, "gpu%d.sock", device);
  c = search_dir(TMS_SYSTEM_DIR, name, known ? uuid : NULL);
  if (c == NULL && known) {
    user_dir(dir, sizeof dir);
    c = search_dir(dir, NULL, uuid);
    if (c == NULL)
      c = tms_start_user_daemon(device, dir, uuid_name(uuid, name, sizeof name));
  }
  return c;
}

sublet_client *tms_daemon_connected(int device) {
  sublet_client *c;

  if (device < 0 || device >= TMS_MAX_DEVICES)
    return NULL;
  pthread_mutex_lock(&daemon_lock);
  c = clients[device];
  pthread_mutex_unlock(&daemon_lock);
  return c;
}

int tms_daemon_on_host(int device) {
  int found;

  pthread_mutex_lock(&daemon_lock);
  found = device >= 0 && device < TMS_MAX_DEVICES && on_host[device];
  pthread_mutex_unlock(&daemon_lock);
  return found;
}

sublet_client *tms_daemon_client(int device) {
  sublet_client *c;

  if (device < 0 || device >= TMS_MAX_DEVICES) {
    tms_fail("CUDA device %d out of range (0 to %d)", device, TMS_MAX_DEVICES - 1);
    return NULL;
  }
  pthread_mutex_lock(&daemon_lock);
  if (clients[device] == NULL && (clients[device] = find(device)) != NULL) {
    struct sublet_info info;
    on_host[device] = sublet_get_info(clients[device], &info) == 0 &&
                      strcmp(info.backend, "memfd") == 0;
  }
  c = clients[device];
  pthread_mutex_unlock(&daemon_lock);
  if (c == NULL)
    tms_fail("no subletd serves CUDA device %d of this process: start one (the system's: "
             "systemctl start subletd@N; or any sublet call from Python starts yours), or set "
             "SUBLET_SOCKET to its socket",
             device);
  return c;
}
