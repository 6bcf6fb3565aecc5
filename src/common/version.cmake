# Writes the build version into OUT (from IN, src/common/version.cc.in): VERSION, then `+` and `git describe` of
# SOURCE_DIR where GIT is set and that is a checkout. Run at configure time and again at every build (the
# odmoe_version target), so a build after a new commit or an edit reports the tree it was built from;
# configure_file leaves an unchanged file alone, so the other builds recompile and relink nothing.
set(ODMOE_BUILD_VERSION "${VERSION}")
if(GIT)
  execute_process(COMMAND "${GIT}" describe --always --tags --dirty=.dirty
    WORKING_DIRECTORY "${SOURCE_DIR}" OUTPUT_VARIABLE _odmoe_git_describe
    RESULT_VARIABLE _odmoe_git_rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_odmoe_git_rc EQUAL 0 AND NOT _odmoe_git_describe STREQUAL "")
    set(ODMOE_BUILD_VERSION "${VERSION}+${_odmoe_git_describe}")
  endif()
endif()
configure_file("${IN}" "${OUT}" @ONLY)
