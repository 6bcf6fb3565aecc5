// The run folders of `odmoe cluster up`: one per up, in creation order, the newest kept, `latest` on the newest.
#include "src/cli/run_folders.h"

#include <filesystem>
#include <set>

#include "gtest/gtest.h"
#include "tests/test_support.h"

namespace odmoe::cli {
namespace {

namespace fs = std::filesystem;

TEST(RunFoldersTest, EachCallMakesANewFolderAndTheNewestAreKept) {
  odmoe::testing::TempDir dir;
  std::vector<std::string> made;
  for (int i = 0; i < 13; ++i) {  // within a second or two: several share a time stamp
    auto folder = NewRunFolder(dir.path(), 4);
    ASSERT_TRUE(folder.ok()) << folder.status();
    ASSERT_TRUE(fs::is_directory(*folder)) << *folder;  // the new folder is never the one pruned
    EXPECT_EQ(fs::canonical(dir.File("latest")), fs::canonical(*folder));
    made.push_back(*folder);
  }
  EXPECT_EQ(std::set<std::string>(made.begin(), made.end()).size(), made.size()) << "every up has its own folder";
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.File("runs"))) left.insert(e.path().string());
  const std::set<std::string> newest(made.end() - 4, made.end());
  EXPECT_EQ(left, newest);
}

TEST(RunFoldersTest, AnUnwritableRunDirIsAnErrorNamingIt) {
  odmoe::testing::TempDir dir;
  odmoe::testing::WriteFile(dir.File("file"), "x");
  auto folder = NewRunFolder(dir.File("file"), 4);
  ASSERT_FALSE(folder.ok());
  EXPECT_NE(folder.status().message().find(dir.File("file")), std::string_view::npos) << folder.status();
}

}  // namespace
}  // namespace odmoe::cli
