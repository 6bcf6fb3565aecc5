# Sets ODMOE_BUILD_VERSION to ODMOE_VERSION_BASE, then `+` and `git describe` of ODMOE_VERSION_SOURCE_DIR where
# ODMOE_VERSION_GIT is set and that is a checkout, and writes it into ODMOE_VERSION_OUT (from
# src/common/version.cc.in, ODMOE_VERSION_IN). Included at configure time and run again at every build (`cmake -P`,
# the odmoe_version target), so a build after a new commit or an edit reports the tree it was built from;
# configure_file leaves an unchanged file alone, so the other builds recompile and relink nothing.
set(ODMOE_BUILD_VERSION "${ODMOE_VERSION_BASE}")
if(ODMOE_VERSION_GIT)
  execute_process(COMMAND "${ODMOE_VERSION_GIT}" describe --always --tags --dirty=.dirty
    WORKING_DIRECTORY "${ODMOE_VERSION_SOURCE_DIR}" OUTPUT_VARIABLE _odmoe_git_describe
    RESULT_VARIABLE _odmoe_git_rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_odmoe_git_rc EQUAL 0 AND NOT _odmoe_git_describe STREQUAL "")
    set(ODMOE_BUILD_VERSION "${ODMOE_VERSION_BASE}+${_odmoe_git_describe}")
  endif()
endif()
configure_file("${ODMOE_VERSION_IN}" "${ODMOE_VERSION_OUT}" @ONLY)
