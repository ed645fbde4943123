#include "shm_heap.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cctype>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>

#include "../common/error.h"

namespace nvrar {

std::pair<uint64_t, char> proc_stat(int64_t pid, uint64_t* flags) {
  if (flags != nullptr) *flags = 0;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  std::ifstream f(path);
  std::string s;
  if (!f || !std::getline(f, s)) return {0, 0};
  size_t rp = s.rfind(')');
  if (rp == std::string::npos || rp + 2 > s.size()) return {0, 0};
  std::istringstream is(s.substr(rp + 2));
  std::string tok;
  char state = 0;
  uint64_t start = 0;
  for (int field = 3; field <= 22 && (is >> tok); ++field) {
    if (field == 3) state = tok.empty() ? 0 : tok[0];
    if (field == 9 && flags != nullptr) *flags = std::strtoull(tok.c_str(), nullptr, 10);
    if (field == 22) start = std::strtoull(tok.c_str(), nullptr, 10);
  }
  return {start, state};
}

void test_kill_point(const std::string& armed, const char* point) {
  if (!armed.empty() && armed == point) kill(getpid(), SIGKILL);
}

namespace {

// The inode of this process's pid namespace (0 if unknown): a pid in a segment's name means
// something only to processes of the same namespace.
uint64_t pid_namespace() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// Names say who created them: /nvrar-<pid namespace>-<pid>-<start time>-<128 random bits>.
// The random part keeps them unguessable; the rest lets a later process of this user recognise
// a segment whose creator died during setup (after setup every name is unlinked at once, so
// only a process killed inside setup leaves one).
std::string random_name() {
  unsigned char buf[16];
  size_t got = 0;
  while (got < sizeof(buf)) {
    ssize_t r = getrandom(buf + got, sizeof(buf) - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      NVRAR_CHECK_ERRNO(false, "getrandom failed while naming a shared-memory segment");
    }
    got += static_cast<size_t>(r);
  }
  char hex[33];
  for (int i = 0; i < 16; ++i) std::snprintf(hex + 2 * i, 3, "%02x", buf[i]);
  const long long pid = getpid();
  return "/nvrar-" + std::to_string(pid_namespace()) + "-" + std::to_string(pid) + "-" +
         std::to_string(proc_stat(pid).first) + "-" + hex;
}

bool all_of(const std::string& s, size_t from, size_t to, int (*pred)(int)) {
  if (from >= to || to > s.size()) return false;
  for (size_t i = from; i < to; ++i)
    if (!pred(static_cast<unsigned char>(s[i]))) return false;
  return true;
}

// The fields of a name (without the leading '/'): "nvrar-NS-PID-START-HEX32" (this version) or
// "nvrar-PID-HEX32" (earlier ones: ns = start = 0). False for anything else.
struct NameFields {
  uint64_t ns = 0;
  long long pid = 0;
  uint64_t start = 0;
};
bool parse_name(const std::string& name, NameFields* f) {
  if (name.rfind("nvrar-", 0) != 0) return false;
  std::vector<std::string> parts;
  size_t pos = 6;
  while (true) {
    const size_t dash = name.find('-', pos);
    parts.push_back(name.substr(pos, dash == std::string::npos ? std::string::npos : dash - pos));
    if (dash == std::string::npos) break;
    pos = dash + 1;
  }
  const std::string& hex = parts.back();
  if (hex.size() != 32 || !all_of(hex, 0, 32, isxdigit)) return false;
  for (size_t i = 0; i + 1 < parts.size(); ++i)
    if (parts[i].empty() || parts[i].size() > 20 || !all_of(parts[i], 0, parts[i].size(), isdigit)) return false;
  if (parts.size() == 4) {
    f->ns = std::strtoull(parts[0].c_str(), nullptr, 10);
    f->pid = std::atoll(parts[1].c_str());
    f->start = std::strtoull(parts[2].c_str(), nullptr, 10);
  } else if (parts.size() == 2) {
    f->pid = std::atoll(parts[0].c_str());
  } else {
    return false;
  }
  return f->pid > 0;
}

constexpr time_t kOrphanAgeS = 3600;  // a segment of unknown creator this old outlived any setup
constexpr uint64_t kPfExiting = 0x4;  // PF_EXITING (linux/sched.h): the process is in exit(), for good

}  // namespace

// Unlink the segments that processes of this user left behind by dying during setup. A creator
// of this pid namespace is dead when its pid is gone, is a zombie, is exiting (set before it closes
// a file: a survivor that saw its sockets close sees it), or now names a process with another
// start time: its segment goes at once. A creator we cannot check (another pid namespace, a name
// of an earlier version) is presumed dead once its segment is an hour old and its pid is absent here.
int sweep_dead_segments() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  const time_t now = time(nullptr);
  const uint64_t my_ns = pid_namespace();
  while (struct dirent* ent = readdir(dir)) {
    const std::string name = ent->d_name;
    NameFields f;
    if (!parse_name(name, &f)) continue;
    struct stat st;
    if (fstatat(dirfd(dir), ent->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) continue;
    bool dead;
    if (f.ns != 0 && f.ns == my_ns && f.start != 0) {
      uint64_t flags = 0;
      const auto ps = proc_stat(f.pid, &flags);
      dead = ps.first != f.start || ps.second == 'Z' || ps.second == 'X' || (flags & kPfExiting) != 0;
    } else {
      dead = now - st.st_mtime >= kOrphanAgeS && kill(static_cast<pid_t>(f.pid), 0) != 0 && errno == ESRCH;
    }
    if (dead && shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

namespace {

char* map_fd(int fd, size_t bytes, const std::string& what) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  NVRAR_CHECK_ERRNO(p != MAP_FAILED, "mmap of ", what, " (", bytes, " bytes) failed");
  return static_cast<char*>(p);
}

std::string mib(unsigned long long bytes) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return os.str();
}

}  // namespace

ShmHeap::ShmHeap(int rank, int world, size_t bytes, const std::string& test_kill_at)
    : rank_(rank), world_(world), bytes_(bytes), creator_pid_(getpid()), kill_at_(test_kill_at),
      bases_(static_cast<size_t>(world), nullptr),
      images_(static_cast<size_t>(world), false) {
  NVRAR_CHECK(rank >= 0 && rank < world, "ShmHeap: rank ", rank, " out of range for world ", world);
  sweep_dead_segments();  // first: their space counts against the reservation below
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    name_ = random_name();
    fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR);
    if (fd < 0 && errno != EEXIST) NVRAR_CHECK_ERRNO(false, "shm_open(", name_, ") failed");
  }
  NVRAR_CHECK(fd >= 0, "shm_open: could not find a free segment name");
  linked_ = true;
  test_kill_point(kill_at_, "shm-opened");
  auto give_up = [&] {
    close(fd);
    unlink();
  };
  // The creation mode is filtered by the umask; peers accept exactly 0600.
  if (fchmod(fd, S_IRUSR | S_IWUSR) != 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    give_up();
    errno = err;
    NVRAR_CHECK_ERRNO(false, "sizing the shared-memory segment to ", bytes, " bytes failed");
  }
  test_kill_point(kill_at_, "shm-sized");
  // Reserve every page now. A sparse segment passes any check of free space and then dies of
  // SIGBUS on first touch once /dev/shm is full (posix_fallocate returns the error code).
  int err;
  do {
    err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (err == EINTR);
  if (err != 0) {
    give_up();
    struct statvfs vfs;
    std::string room = "unknown";
    if (statvfs("/dev/shm", &vfs) == 0)
      room = mib(static_cast<unsigned long long>(vfs.f_bavail) * vfs.f_frsize) + " free of " +
             mib(static_cast<unsigned long long>(vfs.f_blocks) * vfs.f_frsize);
    NVRAR_CHECK(false, "nvrar: rank ", rank, ": cannot reserve ", bytes, " bytes (", mib(bytes),
                ") of shared memory for this rank's segment in /dev/shm: ", std::strerror(err), " (/dev/shm now: ", room,
                "). The ", world, " rank(s) on this host need about ", mib(static_cast<unsigned long long>(bytes) * world),
                " in all: enlarge /dev/shm (docker run --shm-size=", (static_cast<unsigned long long>(bytes) * world >> 20) + 64,
                "m, or mount -o remount,size=... /dev/shm), or lower heap_bytes= (NVRAR_HEAP_BYTES, the empty() pool) "
                "or max_bytes= (NVRAR_MAX_BYTES)");
  }
  test_kill_point(kill_at_, "shm-reserved");
  try {
    bases_[rank_] = map_fd(fd, bytes, "my shared-memory segment");
  } catch (...) {
    give_up();
    throw;
  }
  test_kill_point(kill_at_, "shm-mapped");
  close(fd);
}

bool ShmHeap::in_creator() const { return getpid() == creator_pid_; }

ShmHeap::~ShmHeap() {
  unlink();
  release();
}

void ShmHeap::attach(const std::vector<std::string>& names) {
  NVRAR_CHECK(static_cast<int>(names.size()) == world_, "ShmHeap::attach: got ", names.size(),
              " segment names for a world of ", world_);
  NVRAR_CHECK(names[rank_] == name_, "ShmHeap::attach: rank ", rank_, " found another name at its own index");
  for (int r = 0; r < world_; ++r) {
    if (r == rank_ || names[r].empty()) continue;  // empty: on another host (set_image)
    NameFields f;
    NVRAR_CHECK(names[r].size() > 1 && names[r][0] == '/' && parse_name(names[r].substr(1), &f), "rank ", rank_,
                ": rank ", r, "'s segment name '", names[r].substr(0, 80), "' is not an nvrar segment name");
    int fd = shm_open(names[r].c_str(), O_RDWR | O_NOFOLLOW, 0);
    NVRAR_CHECK_ERRNO(fd >= 0, "rank ", rank_, ": cannot open rank ", r,
                      "'s shared-memory segment (all ranks of the CPU executor must run on one host "
                      "and as one user)");
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int err = errno;
      close(fd);
      errno = err;
      NVRAR_CHECK_ERRNO(false, "rank ", rank_, ": fstat of rank ", r, "'s shared-memory segment failed");
    }
    // Checked on the open descriptor, before anything is mapped: a file another user made (or
    // one others can write) is not a rank's segment, whoever put its name in the exchange.
    if (st.st_uid != geteuid() || !S_ISREG(st.st_mode) || (st.st_mode & 07777) != (S_IRUSR | S_IWUSR)) {
      close(fd);
      char mode[16];
      std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
      NVRAR_CHECK(false, "nvrar: rank ", rank_, ": refusing rank ", r, "'s shared-memory segment ", names[r],
                  ": it belongs to uid ", static_cast<long long>(st.st_uid), " with mode ", mode, ", but a rank's segment belongs to this user (uid ",
                  static_cast<long long>(geteuid()), ") with mode 0600 (another local user tampered with the "
                  "rendezvous, or ranks run as different users)");
    }
    if (static_cast<size_t>(st.st_size) != bytes_) {
      close(fd);
      NVRAR_CHECK(false, "rank ", rank_, ": rank ", r, "'s segment has ", static_cast<long long>(st.st_size),
                  " bytes, expected ", bytes_, " (ranks were configured differently)");
    }
    try {
      bases_[r] = map_fd(fd, bytes_, "a peer's shared-memory segment");
    } catch (...) {
      close(fd);
      throw;
    }
    close(fd);
    mapped_names_.push_back(names[r]);
    test_kill_point(kill_at_, "attach-mapped");  // (with the first peer mapped)
  }
  attached_ = true;
}

void ShmHeap::unlink_attached() {
  if (!in_creator()) return;
  for (const std::string& name : mapped_names_) shm_unlink(name.c_str());  // ENOENT: its creator was first
  mapped_names_.clear();
}

void ShmHeap::unlink() {
  if (linked_ && in_creator()) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void ShmHeap::release() {
  if (!in_creator()) return;  // a forked child: the mappings are the creator's to drop (exit frees them)
  for (size_t r = 0; r < bases_.size(); ++r) {
    if (bases_[r] != nullptr && !images_[r]) munmap(bases_[r], bytes_);
    bases_[r] = nullptr;
    images_[r] = false;
  }
  attached_ = false;
}

}  // namespace nvrar
